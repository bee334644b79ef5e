"""Sleep level 1's parking (llmserve/worker/sleep_park.py) on a small module: the tensors
found (parameters, buffers, a dataclass attribute, a 2 MiB-page buffer) are written out,
their whole pages freed (not resident, mincore(2)), and read back bit-for-bit at the same
addresses; a file cut short is an OSError; oneDNN-packed weights make park decline; a
RAM filesystem is refused."""
from __future__ import annotations

import ctypes
import dataclasses
import os

import pytest
import torch

from llmserve.ops.huge_pages import to_huge_pages
from llmserve.worker import sleep_park

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident(ranges) -> int:
    """Resident pages in ``ranges`` ((address, length), page-aligned), by mincore(2)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = 0
    for addr, length in ranges:
        vec = (ctypes.c_ubyte * (length // PAGE))()
        assert libc.mincore(addr, length, vec) == 0
        n += sum(b & 1 for b in vec)
    return n


@dataclasses.dataclass
class Packed:
    codes: torch.Tensor
    scales: torch.Tensor


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(512, 1024, generator=g), requires_grad=False)  # 2 MiB
        self.register_buffer("table", torch.randn(300, 7, generator=g))  # smaller than a page
        codes, scales = to_huge_pages([torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, generator=g),
                                       torch.randn(4096, generator=g)])
        self.packed = Packed(codes, scales)  # outside parameters/buffers, as the packed GGUF weights are
        self.small = torch.nn.Linear(4, 4)


def test_park_frees_pages_and_unpark_restores_them(tmp_path):
    toy = Toy()
    tensors = [toy.weight, toy.table, toy.packed.codes, toy.packed.scales, toy.small.weight]
    before = [t.clone() for t in tensors]
    ptrs = [t.data_ptr() for t in tensors]
    storages, opaque = sleep_park.model_storages(toy)
    assert opaque == 0
    assert {s.data_ptr() for s in storages} >= {toy.weight.untyped_storage().data_ptr(),
                                               toy.packed.codes.untyped_storage().data_ptr()}
    parked = sleep_park.park(toy, str(tmp_path))
    assert parked is not None and parked.nbytes >= (2 << 20) + (3 << 20) - 4 * PAGE
    assert os.listdir(tmp_path) == []  # unlinked at once: it goes with the fd
    assert os.fstat(parked.fd).st_size == parked.nbytes
    assert resident(parked.ranges) == 0
    sleep_park.unpark(parked)
    assert resident(parked.ranges) == parked.nbytes // PAGE
    assert [t.data_ptr() for t in tensors] == ptrs
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    with pytest.raises(OSError):
        os.fstat(parked.fd)  # closed


def test_unpark_of_a_short_file_raises(tmp_path):
    parked = sleep_park.park(Toy(), str(tmp_path))
    os.ftruncate(parked.fd, PAGE)
    with pytest.raises(OSError, match="ended at byte"):
        sleep_park.unpark(parked)


def test_opaque_weights_decline(tmp_path):
    toy = Toy()
    toy.dense = torch.randn(2048, 2048).to_mkldnn()  # 16 MiB oneDNN tensor, no storage of its own
    assert sleep_park.model_storages(toy)[1] == 2048 * 2048 * 4
    before = toy.weight.clone()
    assert sleep_park.park(toy, str(tmp_path)) is None
    assert torch.equal(toy.weight, before) and os.listdir(tmp_path) == []


def test_park_dir_refuses_ram_filesystems(tmp_path, monkeypatch):
    assert sleep_park._fs_type("/proc/self") == "proc"
    monkeypatch.setattr(sleep_park, "PARK_DIR", str(tmp_path))
    assert sleep_park.park_dir() == str(tmp_path)
    monkeypatch.setattr(sleep_park, "_fs_type", lambda path: "tmpfs")
    assert sleep_park.park_dir() is None
