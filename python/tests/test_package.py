"""The package around the calls: loading the library, devices, the KV cache, torch tensors,
installation into a fresh virtual environment, and the overhead of a call."""
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import libape
from conftest import BUILD, ROOT

HERE = os.path.dirname(os.path.abspath(__file__))


def run_py(code, env=None):
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = os.path.join(ROOT, "python")
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)


def test_missing_library_says_what_was_tried():
    r = run_py("import libape", {"LIBAPE_LIBRARY": "/nonexistent/libape.so.0"})
    assert r.returncode != 0
    assert "LibraryError" in r.stderr
    assert "/nonexistent/libape.so.0 (LIBAPE_LIBRARY)" in r.stderr
    assert "set LIBAPE_LIBRARY" in r.stderr


@pytest.mark.parametrize("device", ["ref", "opencl"])
def test_exit_with_a_kv_cache_open(device):
    """A KV cache still open when the interpreter exits is closed before the context it lives
    in (it was freed after it: a segfault at exit)."""
    r = run_py("import numpy as np, libape\n"
               "c = libape.KVCache(Hkv=2, D=16, capacity_tokens=64, device=%r)\n"
               "x = np.ones((1, 2, 4, 16), np.float32)\n"
               "c.append(x, x)\n"
               "print('open at exit')\n" % device)
    assert r.returncode == 0, r.stderr
    assert "open at exit" in r.stdout


def test_a_plugin_is_a_device():
    """A backend plugin found through APE_BACKEND_PATH (the fixture of tests/plugins/fixture.c,
    which computes nothing and says so) is listed by plugins() and backends(), and device=
    takes its name."""
    so = os.path.join(BUILD, "tests", "plugins", "libape-backend-a.so")
    if not os.path.exists(so):
        pytest.skip("%s is not built (make %s)" % (so, so))
    r = run_py("import numpy as np, libape\n"
               "print([p['name'] for p in libape.plugins() if p['loaded']])\n"
               "print('plug_a' in [b['name'] for b in libape.backends()])\n"
               "q = np.zeros((1, 1, 4, 8), np.float32)\n"
               "try:\n"
               "    libape.attention(q, q, q, device='plug_a')\n"
               "except libape.ApeError as e:\n"
               "    print(e)\n", {"APE_BACKEND_PATH": so})
    assert r.returncode == 0, r.stderr
    assert "['plug_a']" in r.stdout and "True" in r.stdout, r.stdout
    assert "plug_a:0" in r.stdout and "computes nothing" in r.stdout, r.stdout


def test_not_libape_is_refused():
    r = run_py("import libape", {"LIBAPE_LIBRARY": "libm.so.6"})
    assert r.returncode != 0 and "is not libape" in r.stderr


def test_struct_layouts_match_the_header(tmp_path):
    """ctypes mirrors of ape.h's structs: every size and field offset as the C compiler sees
    them."""
    from libape import _capi
    structs = {"ape_tensor": _capi.ApeTensor, "ape_param": _capi.ApeParam,
               "ape_attn_desc": _capi.ApeAttnDesc, "ape_stats": _capi.ApeStats,
               "ape_context_options": _capi.ApeContextOptions,
               "ape_backend_info": _capi.ApeBackendInfo, "ape_device_info": _capi.ApeDeviceInfo,
               "ape_plugin_info": _capi.ApePluginInfo,
               "ape_selection": _capi.ApeSelection,
               "ape_kv_cache_options": _capi.ApeKvCacheOptions,
               "ape_kv_cache_info": _capi.ApeKvCacheInfo}
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ape/ape.h>"]
    if os.path.exists("/usr/include/dlpack/dlpack.h"):
        structs["DLTensor"] = _capi.DLTensor
        lines.append("#include <dlpack/dlpack.h>")
    lines.append("int main(void){")
    expect = []
    for cname, py in structs.items():
        lines.append('printf("%%zu\\n", sizeof(%s));' % cname)
        expect.append(("sizeof " + cname, _capi.ctypes.sizeof(py)))
        for f in py._fields_:
            cf = "lambda" if f[0] == "lambda_" else f[0]
            lines.append('printf("%%zu\\n", offsetof(%s, %s));' % (cname, cf))
            expect.append(("%s.%s" % (cname, cf), getattr(py, f[0]).offset))
    lines.append("return 0;}")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-I", os.path.join(ROOT, "include"), str(src), "-o", str(exe)],
                   check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    assert [(n, v) for (n, v), g in zip(expect, got) if v != g] == []
    assert len(got) == len(expect)


def test_devices_and_backends():
    devs = libape.devices()
    assert devs[-1]["backend"] == "ref" and devs[-1]["kind"] == "reference"
    assert [d["index"] for d in devs] == list(range(len(devs)))
    names = {b["name"]: b for b in libape.backends()}
    assert names["ref"]["available"] and names["ref"]["device_count"] == 1
    for b in names.values():
        assert b["available"] or b["reason"]
    assert libape.version() == "0.1.0" == libape.__version__
    # what each device states it can do: the reference, everything
    words = {"host_memory", "diag", "diag_views", "backward", "resident_backward", "timestamps",
             "segments", "positions", "bias_table", "bwd_segments", "bwd_views"}
    assert set(devs[-1]["capabilities"]) == words
    for d in devs:
        assert set(d["capabilities"]) <= words


@pytest.mark.parametrize("device", [d["spec"] for d in libape.devices()])
def test_kv_cache_equals_one_call(device):
    rng = np.random.default_rng(7)
    k = rng.standard_normal((1, 2, 50, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 50, 16)).astype(np.float32)
    q = rng.standard_normal((1, 4, 3, 16)).astype(np.float32)
    with libape.KVCache(Hkv=2, H=4, D=16, capacity_tokens=64, block_tokens=16,
                        device=device) as c:
        c.append(k[:, :, :30], v[:, :, :30])
        c.append(k[:, :, 30:], v[:, :, 30:])
        o, lse = c.attend(q, return_lse=True)
        info = c.info()
    assert info["tokens"] == 50 and info["next_position"] == 50
    o1, lse1 = libape.attention(q, k, v, device=device, return_lse=True)
    assert np.abs(o - o1).max() <= 1e-4 * np.abs(v).max()
    assert np.abs(lse - lse1).max() <= 1e-4 * max(1.0, np.abs(lse1).max())


def test_kv_cache_errors():
    with pytest.raises(ValueError, match="capacity_tokens"):
        libape.KVCache(Hkv=1, D=8, capacity_tokens=0, device="ref")
    with pytest.raises(ValueError, match="dtype"):
        libape.KVCache(Hkv=1, D=8, capacity_tokens=8, dtype="int8", device="ref")
    c = libape.KVCache(Hkv=1, D=8, capacity_tokens=8, block_tokens=8, device="ref")
    with pytest.raises(libape.ApeError, match="the cache is full|fit"):
        z = np.zeros((1, 1, 9, 8), np.float32)
        c.append(z, z)
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.info()


def test_call_overhead_is_measured():
    """Not a timed assertion: prints the Python overhead of a tiny call over the C call's own
    time (ape_stats.total_ms is not exposed here, so the C side is timed by ape-bench in
    bench/RESULTS.md); the figure goes to the benchmark record, not to a pass/fail."""
    q = np.ones((1, 1, 1, 8), np.float32)
    libape.attention(q, q, q, device="ref")
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        libape.attention(q, q, q, device="ref")
    per = (time.perf_counter() - t) / n * 1e6
    print("libape.attention, tiny call on ref: %.1f us per call" % per)


torch = pytest.importorskip("torch", reason="PyTorch is not installed here (make deps installs "
                                            "it into build/venv)")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 5e-3),
                                        (torch.bfloat16, 2e-2)])
def test_torch_in_torch_out(dtype, tol):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 25, 16, generator=g).to(dtype) for _ in range(3))
    o, lse = libape.attention(q, k, v, device="ref", return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == dtype and lse.dtype == torch.float32
    o64, _ = __import__("aperef").ape64(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                                        libape.SEED_DELTA, libape.SEED_BETA, libape.SEED_GAMMA,
                                        libape.SEED_LAMBDA)
    assert np.abs(o.float().numpy() - o64).max() <= tol * v.float().abs().max().item()
    if dtype != torch.bfloat16:  # NumPy has no bfloat16: the same call from NumPy is identical
        assert np.array_equal(o.numpy(), libape.attention(q.numpy(), k.numpy(), v.numpy(),
                                                          device="ref"))


def test_torch_strided_and_errors():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 30, 2, 16, generator=g)  # [B, L, H, D]
    q = x.transpose(1, 2)
    assert not q.is_contiguous()
    assert torch.equal(libape.attention(q, q, q, device="ref"),
                       libape.attention(q.contiguous(), q.contiguous(), q.contiguous(),
                                        device="ref"))
    with pytest.raises(ValueError, match="mixed kinds"):
        libape.attention(q, q.numpy(), q.numpy(), device="ref")
    with pytest.raises(ValueError, match="dtype torch.float64"):
        libape.attention(q.double(), q, q, device="ref")


def test_pip_install_into_a_fresh_venv(tmp_path):
    """`pip install ./python` bundles the build tree's library; the installed package imports
    and computes with no LIBAPE_LIBRARY and no source tree on the path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    py = str(venv / "bin" / "python")
    env = dict(os.environ, LIBAPE_BUILD=BUILD, PIP_NO_INDEX="1")
    env.pop("LIBAPE_LIBRARY", None)
    env.pop("PYTHONPATH", None)
    src = tmp_path / "python"  # a copy: building writes next to the sources
    shutil.copytree(os.path.join(ROOT, "python"), str(src),
                    ignore=shutil.ignore_patterns("_lib", "build", "*.egg-info", "__pycache__"))
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-build-isolation", str(src)],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    code = ("import libape, numpy as np; q = np.ones((1, 1, 4, 8), np.float32);"
            "print(libape.library_path); print(libape.attention(q, q, q, device='ref').shape)")
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    path, shape = r.stdout.split("\n")[:2]
    assert path.startswith(str(venv)) and path.endswith("libape/_lib/libape.so.0")
    assert shape == "(1, 1, 4, 8)"
