"""The Python client's shared memory (SharedMemoryRegion) against the real
plsh-server with --shm-dir: arrays of a region are named instead of sent,
outputs land in region arrays, and the answer is the streamed one bit for
bit. Also the input chunks written by hand: protobuf reads them."""

import os
import tempfile

import grpc
import numpy as np
import pytest

from conftest import Server
from plsh_client import Client, PlshError, SharedMemoryRegion
from plsh_client._proto import pb
from plsh_client._wire import chunk_prefix


@pytest.fixture(scope="module")
def shm_server():
    directory = tempfile.mkdtemp(prefix="plsh-py-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    s = Server("--shm-dir", directory)
    s.directory = directory
    yield s
    assert s.stop() == 0, "".join(s.log)
    os.rmdir(directory)


def inputs(seed=0):
    r = np.random.default_rng(seed)
    return (r.standard_normal((2, 70, 4, 32)).astype(np.float32), r.standard_normal((2, 90, 2, 32)).astype(np.float32),
            r.standard_normal((2, 90, 2, 32)).astype(np.float32))


def test_region_arrays_are_read_and_written_in_place(shm_server):
    q, k, v = inputs()
    with Client(shm_server.address) as c:
        assert c.info().limits.shared_memory
        ref, ref_meta = c.attend(q, k, v, mode="lsh", samples=16, causal=True, return_lse=True, chunk_bytes=3000)
        with c.shm_region(1 << 20, name="inputs", dir=shm_server.directory) as region:
            rq, rk, rv = (region.array(a.shape, a.dtype) for a in (q, k, v))
            rq[...], rk[...], rv[...] = q, k, v
            out = region.array(q.shape, np.float32)
            lse = region.array(q.shape[:3], np.float32)
            got, meta = c.attend(rq, rk, rv, mode="lsh", samples=16, causal=True, out=out, lse=lse)
            assert got is out and meta["lse"] is lse
            assert np.array_equal(out, ref) and np.array_equal(lse, ref_meta["lse"])
            assert meta["received_bytes"] == 0 and meta["sent_bytes"] == 0
            # Mixed: q in place, k and v streamed, the output streamed back.
            mixed, meta = c.attend(rq, k, v, mode="lsh", samples=16, causal=True)
            assert np.array_equal(mixed, ref)
            assert meta["received_bytes"] == k.nbytes + v.nbytes
            listed = c.list_shm()
            assert [(r["name"], r["key"], r["byte_size"], r["requests"]) for r in listed] == \
                [("inputs", region.key, 1 << 20, 0)]
        assert c.list_shm() == []
        assert not os.path.exists(os.path.join(shm_server.directory, region.key))


def test_misuse_raises_with_the_servers_code(shm_server, server):
    q, k, v = inputs(1)
    with Client(shm_server.address) as c:
        with pytest.raises(PlshError) as e:
            c.register_shm("r", "../../etc/passwd", 0, 16)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "passwd" not in e.value.details
        with pytest.raises(PlshError) as e:
            c.register_shm("r", "plsh-does-not-exist", 0, 16)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with c.shm_region(4096, dir=shm_server.directory) as region:
            with pytest.raises(PlshError) as e:
                c.register_shm("again", region.key, 4000, 100)  # beyond the file
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(ValueError):
                c.attend(q, k, v, out=np.empty_like(q))  # out= must be in a region
        assert c.list_shm() == []
    with Client(server.address) as c:  # a server without --shm-dir
        assert not c.info().limits.shared_memory
        with pytest.raises(PlshError) as e:
            c.list_shm()
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_chunk_writer_agrees_with_protobuf():
    """What the client writes by hand (to put the data in the message in one
    copy) is what protobuf reads; responses are read by protobuf itself."""
    data = np.random.default_rng(2).bytes(1000)
    request = pb.AttendRequest.FromString(chunk_prefix(2, pb.TENSOR_K, 7, 3, len(data)) + data)
    assert (request.chunk.tensor, request.chunk.row_start, request.chunk.row_count, request.chunk.data) == \
        (pb.TENSOR_K, 7, 3, data)
    big = pb.BackwardRequest.FromString(chunk_prefix(2, pb.TENSOR_DOUT, 2**40, 2**20, len(data)) + data)
    assert (big.chunk.tensor, big.chunk.row_start, big.chunk.row_count) == (pb.TENSOR_DOUT, 2**40, 2**20)


def test_region_files_are_private_and_removed():
    directory = tempfile.mkdtemp(prefix="plsh-py-files-")

    class Offline:  # registers nothing
        _regions = []

        def register_shm(self, *args):
            pass

        def unregister_shm(self, *args):
            pass

    region = SharedMemoryRegion(Offline(), 8192, dir=directory)
    path = os.path.join(directory, region.key)
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(path).st_size == 8192
    a = region.array((10,), np.float32)
    b = region.array((3,), np.float16)
    assert b.__array_interface__["data"][0] - a.__array_interface__["data"][0] == 4096
    with pytest.raises(ValueError):
        region.array((4096,), np.float32)  # past the end
    del a, b
    region.close()
    assert not os.path.exists(path)
    os.rmdir(directory)


def test_cli_attend_and_bench_with_shm(shm_server, tmp_path):
    """plsh attend --shm equals plsh attend over the socket; plsh bench --shm
    verifies its responses; neither leaves a file or a region behind."""
    import json
    import subprocess
    cli = os.environ["PLSH_CLI"]
    q, k, v = inputs(3)
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    common = ["attend", "--target", shm_server.address, "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"),
              "--v", str(tmp_path / "v.npy"), "--mode", "window", "--causal"]
    for suffix, extra in (("socket", []), ("shm", ["--shm", "--shm-dir", shm_server.directory])):
        r = subprocess.run([cli, *common, "--out", str(tmp_path / f"out_{suffix}.npy"),
                            "--lse", str(tmp_path / f"lse_{suffix}.npy"), "--meta", str(tmp_path / f"{suffix}.json"),
                            *extra], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    for name in ("out", "lse"):
        assert np.array_equal(np.load(tmp_path / f"{name}_socket.npy"), np.load(tmp_path / f"{name}_shm.npy"))
    meta = json.loads((tmp_path / "shm.json").read_text())["server"]
    assert meta["shared_memory"] and meta["sent_bytes"] == 0 and meta["received_bytes"] == 0
    r = subprocess.run([cli, "bench", "--target", shm_server.address, "--shape", "1,256,4,2,32", "--mode", "exact",
                        "--concurrency", "1,2", "--requests", "4", "--warmup", "0", "--verify", "1", "--quiet",
                        "--shm", "--shm-dir", shm_server.directory, "--json", str(tmp_path / "bench.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["shared_memory"] is True
    assert [(level["ok"], level["verify"]["mismatches"]) for level in report["levels"]] == [(4, 0), (4, 0)]
    assert [f for f in os.listdir(shm_server.directory)] == []
    with Client(shm_server.address) as c:
        assert c.list_shm() == []
