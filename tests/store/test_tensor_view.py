"""MLX's loader over pieces of real files (store/tensor_view.py) and the restore's checksum pool."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from mlxq.store import tensor_view
from mlxq.store.tensor_view import SafetensorsView, TensorPiece, load_pieces
from mlxq.store.verify_pool import TensorCheck, Verification

# (mlxkv dtype name, numpy dtype of the same bytes, shape)
CASES = [("bfloat16", np.uint16, (1, 2, 7, 4)), ("float16", np.float16, (3, 5)), ("float32", np.float32, (2, 9)),
         ("uint32", np.uint32, (4, 4)), ("bool_", np.bool_, (6,)), ("float64", np.float64, (5,)),
         ("int8", np.int8, (0, 3))]


def write_pieces(path, arrays: list[np.ndarray], gap: int = 13) -> list[int]:
    """The arrays' bytes at odd offsets (``gap`` bytes of junk before each); their offsets."""
    offsets, data = [], bytearray()
    for a in arrays:
        data += os.urandom(gap)
        offsets.append(len(data))
        data += a.tobytes()
    path.write_bytes(bytes(data))
    return offsets


def sample(np_dtype, shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np_dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(np_dtype, np.floating):
        return rng.standard_normal(shape).astype(np_dtype)
    return rng.integers(0, np.iinfo(np_dtype).max, shape, dtype=np_dtype)


def as_bytes(array: mx.array) -> bytes:
    return bytes(memoryview(mx.contiguous(array)).cast("B")) if array.size else b""


@pytest.mark.parametrize("threads", [0, 3])
def test_every_dtype_loads_its_exact_bytes_from_any_offset(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(tensor_view, "READ_CHUNK", 40)  # several chunks per tensor: the pool splits reads
    arrays = [sample(np_dtype, shape, i) for i, (_, np_dtype, shape) in enumerate(CASES)]
    offsets = write_pieces(tmp_path / "f", arrays)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        pieces = [TensorPiece(f"t{i}", fd, at, a.nbytes, a.shape, name)
                  for i, ((name, _, _), a, at) in enumerate(zip(CASES, arrays, offsets, strict=True))]
        with ThreadPoolExecutor(threads or 1) as pool:
            loaded, short = load_pieces(pieces, pool if threads else None)
    finally:
        os.close(fd)
    assert short == []
    for i, ((name, _, shape), a) in enumerate(zip(CASES, arrays, strict=True)):
        got = loaded[f"t{i}"]
        assert got.shape == shape and got.dtype == getattr(mx, name)
        assert as_bytes(got) == a.tobytes()


def test_a_file_that_ends_early_names_the_short_piece_and_never_raises(tmp_path):
    a = sample(np.float32, (4, 8), 0)
    (tmp_path / "f").write_bytes(a.tobytes()[:-10])
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        loaded, short = load_pieces([TensorPiece("keys", fd, 0, a.nbytes, a.shape, "float32"),
                                     TensorPiece("values", fd, a.nbytes, a.nbytes, a.shape, "float32")])
    finally:
        os.close(fd)
    assert sorted(short) == ["keys", "values"]
    assert as_bytes(loaded["keys"])[: a.nbytes - 10] == a.tobytes()[:-10]
    assert as_bytes(loaded["values"]) == bytes(a.nbytes)  # zero-filled, never used: the restore is a miss


def test_checks_pass_on_good_bytes_and_name_a_flipped_or_missing_tensor(tmp_path):
    blocks = [os.urandom(1000 + 77 * i) for i in range(5)]
    (tmp_path / "f").write_bytes(b"".join(blocks))
    digests = [xxhash.xxh3_128_hexdigest(b) for b in blocks]
    starts = np.cumsum([0] + [len(b) for b in blocks]).tolist()
    fd = os.open(tmp_path / "f", os.O_RDONLY)

    def checks(**bad) -> Verification:
        return Verification([TensorCheck(f"file{i}", f"t{i}", fd, starts[i], bad.get(f"n{i}", len(b)),
                                         bad.get(f"h{i}", digests[i])) for i, b in enumerate(blocks)])
    try:
        good = checks()
        assert good.wait() is None
        good.close()
        flipped = checks(h3="0" * 32)
        assert flipped.wait() == ("file3", "tensor 't3' fails its checksum")
        flipped.close()
        past_end = checks(n4=len(blocks[4]) + 1)
        assert past_end.wait() == ("file4", "tensor 't4' is truncated")
        past_end.close()
    finally:
        os.close(fd)


def test_a_read_error_is_a_short_piece_not_an_exception_inside_mlx(tmp_path):
    (tmp_path / "f").write_bytes(bytes(64))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    os.close(fd)  # reads now fail with EBADF
    loaded, short = load_pieces([TensorPiece("keys", fd, 0, 64, (16,), "float32")])
    assert short == ["keys"] and as_bytes(loaded["keys"]) == bytes(64)


def test_a_check_that_cannot_read_its_file_fails_it_cleanly(tmp_path):
    (tmp_path / "f").write_bytes(bytes(64))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    os.close(fd)  # reads now fail with EBADF
    checks = Verification([TensorCheck("file", "keys", fd, 0, 64, xxhash.xxh3_128_hexdigest(bytes(64)))])
    key, message = checks.wait()
    checks.close()
    assert key == "file" and message.startswith("tensor 'keys' cannot be read")


@pytest.mark.skipif(mx.cuda.is_available(), reason="CUDA loads through MLX instead")
def test_host_memory_backends_read_rows_into_place():
    from mlxq.store import restore_reads

    assert restore_reads.placement() is restore_reads.HostRows


def test_a_read_past_its_piece_is_short_and_zero_filled_not_the_next_bytes(tmp_path):
    path = tmp_path / "two.bin"
    path.write_bytes(bytes(range(1, 65)) * 2)  # the first piece's 64 bytes, then another tensor's
    with open(path, "rb") as f:
        view = SafetensorsView([TensorPiece("keys", f.fileno(), 0, 64, (16,), "float32")])
        header = view.seek(0, io.SEEK_END) - 64
        view.seek(header + 60)
        buffer = bytearray(8)
        view.readinto(buffer)
    assert view.short == ["keys"] and bytes(buffer) == bytes(8)
