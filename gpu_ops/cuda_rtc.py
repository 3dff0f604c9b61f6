"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API (ctypes).

Why: a few kernels need what Triton does not let us say, e.g. which lane holds which operand of
a warp's `mma.sync` (`gpu_ops.nf4_tc`). NVRTC ships with PyTorch's CUDA wheels (and the CUDA
toolkit), so this needs no compiler on the user's machine. A kernel is compiled once per GPU
architecture and kept in the user's cache folder (`hetero.paths.cache_dir() / "cubin"`); each
device loads its own module.

Launches go to the caller's current torch stream, so they are captured by CUDA graphs like any
other kernel; `pdl=True` adds the programmatic-stream-serialization attribute (`gpu_ops.pdl`),
and such a kernel must execute `griddepcontrol.wait` before it reads what earlier kernels wrote.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import sys

import torch

from hetero.paths import cache_dir

log = logging.getLogger(__name__)
_PSS = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context


class _Attr(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("nattrs", ctypes.c_uint)]


_PDL_ATTR = ctypes.pointer(_Attr(id=_PSS, value=(1).to_bytes(4, "little")))  # the same for every launch


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _libnvrtc() -> ctypes.CDLL:
    """NVRTC of torch's CUDA major version: by its soname, else from the nvidia-* wheels on sys.path."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for p in sys.path:
        names += sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"NVRTC for CUDA {major} not found (looked for {names[:2]} and in the nvidia wheels)")


@functools.cache
def available(device: torch.device) -> bool:
    """A CUDA device of compute capability ≥ 8.0 (bf16 mma.sync) and an NVRTC to compile for it."""
    if device.type != "cuda" or torch.version.cuda is None or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    try:
        _libnvrtc(), _libcuda()
    except OSError:
        return False
    return True


def _check(rc: int, what: str) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """source (CUDA C++, no headers) → a cubin for `arch` ("90" for sm_90), cached on disk."""
    key = hashlib.sha256(f"{arch}\0{name}\0{source}".encode()).hexdigest()[:24]
    path = cache_dir() / "cubin" / f"{name}-sm{arch}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    nvrtc = _libnvrtc()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
    if rc:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc})")
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17", b"-default-device"]
    try:
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name} for sm_{arch}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    try:  # the cache only saves the next start a compile
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin.raw)
        tmp.replace(path)
    except OSError as e:
        log.warning("could not keep the compiled %s in %s: %s", name, path.parent, e)
    return cubin.raw


def _make_current(device: torch.device) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    ctx = ctypes.c_void_p()
    _check(_libcuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device.index), "cuDevicePrimaryCtxRetain")
    _check(_libcuda().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Kernel:
    """One `extern "C"` kernel of a CUDA C++ source, loaded on each device it is launched on."""

    def __init__(self, source: str, name: str):
        self.source, self.name = source, name
        self._funcs: dict[int, ctypes.c_void_p] = {}

    def load(self, device: torch.device) -> ctypes.c_void_p:
        """The kernel's function on `device`: compiled (or read from the cache) and loaded on first use."""
        f = self._funcs.get(device.index)
        if f is None:
            major, minor = torch.cuda.get_device_capability(device)
            cubin = compile_cubin(self.source, self.name, f"{major}{minor}")
            _make_current(device)
            module, f = ctypes.c_void_p(), ctypes.c_void_p()
            _check(_libcuda().cuModuleLoadData(ctypes.byref(module), cubin), f"loading {self.name}")
            _check(_libcuda().cuModuleGetFunction(ctypes.byref(f), module, self.name.encode()), self.name)
            self._funcs[device.index] = f
        return f

    def launch(self, device: torch.device, grid: tuple[int, int, int], block: int, args: list,
               pdl: bool = False, smem: int = 0) -> None:
        """args: ctypes values (c_void_p for pointers, c_int, c_longlong, c_uint), in the kernel's order."""
        func = self.load(device)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        cfg = _Config(grid[0], grid[1], grid[2], block, 1, 1, smem,
                      torch.cuda.current_stream(device).cuda_stream, _PDL_ATTR, 1 if pdl else 0)
        rc = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
        if rc == _INVALID_CONTEXT:  # a thread torch has not used yet
            _make_current(device)
            rc = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
        _check(rc, f"launching {self.name}")
