"""Two gaps of Triton 3.6's interpreter, patched for the tests that run kernels on CPU tensors."""

from __future__ import annotations


def patch_interpreter() -> None:
    """Three gaps of Triton 3.6's interpreter that the compiled kernels do not have.

    - Loop bounds loaded from memory are 1-element arrays, which it turns into ints with int(),
      an error from NumPy 2.4 on (triton-lang/triton#9171; the upstream fix squeezes first).
    - It stores bfloat16 as uint16 bit patterns and multiplies those in tl.dot
      (triton-lang/triton#11584), and float8 as uint8 ones; widening bf16 and e4m3 operands to fp32
      first is exact.
    - Its narrowing to float8 e4m3 rounds half up and drops the carry into the exponent (7.875
      becomes 4.0), where the GPU's conversion rounds to nearest even: narrowing goes through torch,
      which rounds as the GPU does.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_ferry_patched", False):
        return
    interpreter._ferry_patched = True

    patch_tensor, create_dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def widen(handle):
        if handle.dtype.scalar == tl.float8e4nv:  # (the same gap: e4m3 bytes multiplied as integers)
            import torch

            data = torch.from_numpy(np.ascontiguousarray(handle.data)).view(torch.float8_e4m3fn).float().numpy()
            return interpreter.TensorHandle(data, tl.float32)
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), acc, input_precision, max_num_imprecise_acc)

    convert_float = interpreter._convert_float

    def patched_convert_float(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype.primitive_bitwidth <= 8:
            return convert_float(data, input_dtype, output_dtype, rounding_mode)
        import torch

        if input_dtype != tl.float32:  # widening to float32 is exact
            data = convert_float(data, input_dtype, tl.float32, None).view(np.float32)
        wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter._convert_float = patched_convert_float
