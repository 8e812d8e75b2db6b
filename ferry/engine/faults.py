"""Which exceptions end the engine: faults of the device, after which nothing on it can be trusted.

Anything else raised inside a step is a fault of the step (a bug met by one batch, a request the
checks let through), and the engine fails that step's requests and goes on (`LLMEngine.step`). A
CUDA error is sticky: the context is broken and every later kernel fails too, so the process ends
and the server starts a new one (`AsyncEngine` with a `RestartPolicy`, engine/async_engine.py).
"""

from __future__ import annotations

import sys

_DEVICE_FAULT_TEXT = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "cuDNN error")


def is_device_fault(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: no device to have failed
    accelerator_error = getattr(torch, "AcceleratorError", None) if torch is not None else None
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return any(marker in text for marker in _DEVICE_FAULT_TEXT)
