"""The torch.save-compatible record writer and locator (strategies/dcp/record.py).

Written blobs must be what torch.save writes (same data.pkl bytes, valid zip CRCs, torch.load
reads them back bit-exact), and the locator must find the tensor bytes in blobs written by
torch.save itself as well as by us, and decline anything that is not a plain tensor.
"""

import io
import zipfile

import pytest
import torch

from dist_ckpt.strategies.dcp import record as tr

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.int64, torch.uint8,
          torch.complex64, torch.float8_e4m3fn, torch.uint16]
SHAPES = [(), (0,), (3,), (2, 3), (1, 5, 1)]


def _example(dtype: torch.dtype, shape) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return (torch.arange(n) % 3).to(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(tr.tensor_bytes(t.contiguous()))


def _ours(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    tr.write_tensor_record(out.write, t)
    return out.getvalue()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_written_record_is_what_torch_save_writes(dtype):
    for shape in SHAPES:
        t = _example(dtype, shape)
        ours, ref = io.BytesIO(_ours(t)), io.BytesIO()
        torch.save(t, ref)
        with zipfile.ZipFile(ours) as zf, zipfile.ZipFile(ref) as zr:
            assert zf.testzip() is None  # every CRC32 is right
            assert zf.read("archive/data.pkl") == zr.read("archive/data.pkl")
            assert sorted(zf.namelist()) == sorted(zr.namelist())
        back = torch.load(io.BytesIO(ours.getvalue()), weights_only=True)
        assert back.dtype == dtype and back.shape == t.shape and _bits(back) == _bits(t)


@pytest.mark.parametrize("writer", ["ours", "torch.save"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_locate_finds_the_bytes(dtype, writer):
    for shape in SHAPES:
        t = _example(dtype, shape)
        if writer == "ours":
            blob = _ours(t)
        else:
            buffer = io.BytesIO()
            torch.save(t, buffer)
            blob = buffer.getvalue()
        view = memoryview(blob)
        found = tr.locate_tensor_data(view, view, len(blob))
        assert found is not None and found.dtype == dtype and found.shape == tuple(shape)
        assert blob[found.data_offset : found.data_offset + found.nbytes] == _bits(t)
        if writer == "ours":
            assert found.data_offset % tr.ALIGNMENT == 0
        # head up to the data, tail from the end of the data: enough to locate
        head, tail = view[: found.data_offset], view[found.data_offset + found.nbytes :]
        again = tr.locate_tensor_data(head, tail, len(blob))
        assert again == found


def test_zip64_records(monkeypatch):
    """Sizes and offsets at or above the zip64 limit go into zip64 extra fields (the limit is
    lowered here: a 4 GiB tensor would make the test slow); zipfile and torch.load read it."""
    monkeypatch.setattr(tr, "ZIP64_LIMIT", 100)
    t = torch.arange(1000, dtype=torch.float32)
    blob = _ours(t)
    monkeypatch.setattr(tr, "ZIP64_LIMIT", 0xFFFFFFFF)  # readers use the real limit
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        assert zf.testzip() is None
        info = zf.getinfo("archive/data/0")
        assert info.file_size == 4000 and b"\x01\x00" in info.extra[:2]
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)
    view = memoryview(blob)
    found = tr.locate_tensor_data(view, view, len(blob))
    assert found is not None and blob[found.data_offset : found.data_offset + found.nbytes] == _bits(t)


def test_locate_declines_what_is_not_a_plain_tensor():
    cases = {}
    view_of_larger = torch.arange(10, dtype=torch.float32)[2:5]  # torch.save writes the whole storage
    for name, obj in {"view": view_of_larger, "list": [torch.ones(2)], "dict": {"a": 1},
                      "transposed": torch.arange(6.0).reshape(2, 3).t()}.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        cases[name] = buffer.getvalue()
    cases["not a zip"] = b"\x80\x02K\x01." * 10
    cases["truncated"] = _ours(torch.ones(4))[:-30]
    for name, blob in cases.items():
        view = memoryview(blob)
        assert tr.locate_tensor_data(view, view, len(blob)) is None, name
    blob = _ours(torch.ones(4))
    view = memoryview(blob)
    assert tr.locate_tensor_data(view[:10], view, len(blob)) is None  # head too short: declined


def test_tensor_bytes_is_a_view_not_a_copy():
    t = torch.zeros(4, dtype=torch.float32)
    view = tr.tensor_bytes(t)
    view[0:4] = b"\x00\x00\x80\x3f"
    assert t[0].item() == 1.0


def test_tensor_bytes_of_odd_strided_contiguous_tensors():
    """torch calls a tensor contiguous when only size-1 axes have odd strides."""
    base = torch.arange(8, dtype=torch.bfloat16)
    one = base.as_strided((1, 1), (2, 2), 3)
    assert one.is_contiguous()
    assert bytes(tr.tensor_bytes(one)) == bytes(tr.tensor_bytes(base[3:4].clone()))
    column = base.as_strided((2, 1), (1, 2))
    assert column.is_contiguous()
    assert bytes(tr.tensor_bytes(column)) == bytes(tr.tensor_bytes(base[:2].clone()))
