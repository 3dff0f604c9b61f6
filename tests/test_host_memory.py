"""The KV pool's host memory (`cpu_attention.host_memory`): zeroed, writable, 2 MiB-aligned."""
import torch

from cpu_attention import HostKVPool, KVDtype, host_memory


def test_large_tensors_start_on_a_huge_page_and_hold_zeros():
    t = host_memory.zeros((3, 1 << 20), torch.bfloat16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not bool(t.any())
    t[2, -1] = 1.5  # the last element is inside the mapping and writable
    assert float(t[2, -1]) == 1.5 and float(t.float().sum()) == 1.5


def test_small_tensors_are_plain_zeros():
    t = host_memory.zeros((7, 5), torch.float32)
    assert t.shape == (7, 5) and not bool(t.any())


def test_pool_arrays_view_the_same_memory():
    pool = HostKVPool(2, 512, 4, 16, 64, KVDtype.INT4)
    assert pool.k.data_ptr() % host_memory.HUGE_PAGE == 0
    pool.k[1, 3, 2, 0, 5, 1] = 9
    assert pool.arrays["k"][1, 3, 2, 0, 5, 1] == 9
    assert not pool.k.is_pinned()
