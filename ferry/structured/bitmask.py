"""The allowed tokens of a step's rows as a bitmask, filled on the host and applied on the device.

One bit per token, 32 tokens an int32 word (llguidance's layout: bit b of word w is token 32w + b).
A row with no grammar is all ones. The host fills the mask while the device runs the step's
forward; the mask then goes to the device in one copy and bans every token whose bit is 0:

    word w of row r:  0b...1011  ->  tokens 32w+0, 32w+1, 32w+3 allowed, 32w+2 banned (-inf)
"""

from __future__ import annotations

import torch


def new_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """(num_rows, ceil(vocab / 32)) int32, every token allowed."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pin_memory)


def only_row(vocab_size: int, token_ids) -> torch.Tensor:
    """One row, (ceil(vocab / 32),) int32, that allows only `token_ids`."""
    words = torch.zeros(-(-vocab_size // 32), dtype=torch.int64)
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # bit 31: the sign


class HostBitmasks:
    """The host side of successive steps' bitmasks, in two buffers taken in turn and kept: pinned
    memory for a copy that does not wait, which is slow to allocate (slower than filling the masks of a
    batch of 64), so it is allocated once, as is the device buffer each one is copied into. A buffer
    is taken again only after the device has copied it out (an event recorded behind the copy), two
    steps later; its device buffer is then free too, its readers queued before the new copy."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = -(-vocab_size // 32)
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._on_device: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # recorded behind each one's last copy
        self._turn = 0

    def take(self, num_rows: int) -> torch.Tensor:
        """A (num_rows, words) int32 host view, its contents left from before: fill every row."""
        i = self._turn = 1 - self._turn
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # (at once for an event never recorded)
        buffer = self._buffers[i]
        if buffer is None or buffer.shape[0] < num_rows:
            cuda = self.device.type == "cuda"
            shape = (max(num_rows, 64), self.words)
            buffer = self._buffers[i] = torch.empty(shape, dtype=torch.int32, pin_memory=cuda)
            if cuda:
                self._on_device[i] = torch.empty(shape, dtype=torch.int32, device=self.device)
                self._copied[i] = torch.cuda.Event()
        return buffer[:num_rows]

    def to_device(self, bitmask: torch.Tensor) -> torch.Tensor:
        """A taken view, on the device: a copy queued on the current stream (on a CPU, a copy made
        now, so that the buffer can be taken again)."""
        if self.device.type != "cuda":
            return bitmask.clone()
        first = self._buffers[0]
        i = 0 if first is not None and bitmask.data_ptr() == first.data_ptr() else 1
        on_device = self._on_device[i][:bitmask.shape[0]]
        on_device.copy_(bitmask, non_blocking=True)
        self._copied[i].record()
        return on_device


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (R, V) float32 -> a new (R, V) tensor, -inf where the bit of (row, token) is 0; bitmask
    (R, ceil(V/32)) on the logits' device. On CUDA one Triton kernel; elsewhere torch ops (the
    reference)."""
    if logits.device.type == "cuda":
        from ferry.kernels.bitmask import masked_logits_kernel

        return masked_logits_kernel(logits, bitmask)
    return masked_logits_reference(logits, bitmask)


def masked_logits_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab]  # (R, V) 0/1
    return logits.masked_fill(allowed == 0, float("-inf"))
