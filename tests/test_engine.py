"""The pipelined engine: byte-identical output for any number of workers, in-place shard files,
every scheme end to end, and no partial output after a failure."""

from __future__ import annotations

import ctypes
import errno

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save, save_file

from quantize_moe.quantization import fp8
from quantize_moe.source.checkpoint import Checkpoint
from quantize_moe.errors import UserError
from quantize_moe.plan.plan import OutputTensor
from quantize_moe.plan.options import Options
from quantize_moe.write.job import quantize_checkpoint
from quantize_moe.quantization.schemes import SCHEMES
from quantize_moe.write import shard_file
from quantize_moe.source.tensor_bytes import read_into
from quantize_moe.source.locations import data_offsets
from quantize_moe.write.shard_file import ShardFile, safetensors_header

SMALL_SHARDS = 60_000


def shard_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("write_behind_from", [shard_file.WRITE_BEHIND_MIN_BYTES, 1])
def test_shard_file_filled_in_place_equals_save_file(tmp_path, monkeypatch, write_behind_from):
    monkeypatch.setattr(shard_file, "WRITE_BEHIND_MIN_BYTES", write_behind_from)  # 1: every write behind
    tensors = {"b.weight": torch.randn(5, 7).to(fp8.FP8_DTYPE), "a.weight_scale": torch.tensor(3.0),
               "c": torch.randn(3, 2, dtype=torch.bfloat16), "empty": torch.empty(0)}
    shard = ShardFile(tmp_path / "in-place.safetensors",
                      [OutputTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    assert (tmp_path / "in-place.safetensors.partial").exists()
    for name in ["c", "empty", "a.weight_scale", "b.weight"]:  # any order
        shard.write(name, tensors[name])
    shard.finish()
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "in-place.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def direct_writes(monkeypatch) -> list[tuple[int, int]]:
    """Record (offset, byte count) of every write made around the page cache, from now on; skip
    the test where this file system does not offer that."""
    descriptors, writes = set(), []
    open_direct, write_all_at = shard_file._open_direct, shard_file.write_all_at

    def recording_open(path):
        fd = open_direct(path)
        if fd is None:
            pytest.skip("the file system of the test folder has no O_DIRECT")
        descriptors.add(fd)
        return fd

    def recording_write(fd, offset, view):
        if fd in descriptors:
            writes.append((offset, len(view)))
        write_all_at(fd, offset, view)

    monkeypatch.setattr(shard_file, "_open_direct", recording_open)
    monkeypatch.setattr(shard_file, "write_all_at", recording_write)
    return writes


def test_whole_pages_are_written_direct_where_the_bytes_line_up(tmp_path, monkeypatch):
    writes = direct_writes(monkeypatch)
    monkeypatch.setattr(shard_file, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(shard_file, "COPY_BUFFER_BYTES", 2 * shard_file.DIRECT_ALIGNMENT)  # copies in chunks
    page = shard_file.DIRECT_ALIGNMENT
    tensors = {"a.weight": torch.randn(3 * page + 77).to(fp8.FP8_DTYPE),  # lined up below: written direct
               "b.weight": torch.randn(2 * page + 5).to(fp8.FP8_DTYPE),  # not lined up: through the page cache
               "c.bias": torch.randn(page + 3, dtype=torch.bfloat16),  # copied from a file, in chunks
               "d.weight_scale": torch.tensor([0.5, 2.0])}
    shard = ShardFile(tmp_path / "out.safetensors",
                      [OutputTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    buffer = torch.empty(tensors["a.weight"].nbytes + page, dtype=torch.uint8)
    lined_up = shard_file.placed(buffer, 0, tensors["a.weight"].nbytes, shard.offsets["a.weight"])
    lined_up.copy_(tensors["a.weight"].view(torch.uint8))
    shard.write("a.weight", lined_up.view(fp8.FP8_DTYPE))
    a_writes = list(writes)
    unaligned = torch.empty(tensors["b.weight"].nbytes + page, dtype=torch.uint8)
    unaligned = unaligned[(shard.offsets["b.weight"] - unaligned.data_ptr() + 1) % page:][:tensors["b.weight"].nbytes]
    unaligned.copy_(tensors["b.weight"].view(torch.uint8))
    shard.write("b.weight", unaligned.view(fp8.FP8_DTYPE))
    assert writes == a_writes
    save_file({"c.bias": tensors["c.bias"]}, tmp_path / "src.safetensors")
    source_offset = data_offsets(tmp_path / "src.safetensors", {"c.bias": tensors["c.bias"].nbytes})["c.bias"]
    with open(tmp_path / "src.safetensors", "rb") as source:
        scratch = torch.empty(shard_file.copy_scratch_bytes(tensors["c.bias"].nbytes), dtype=torch.uint8)
        shard.copy_from("c.bias", source.fileno(), source_offset, tensors["c.bias"].nbytes, scratch)
    shard.write("d.weight_scale", tensors["d.weight_scale"])
    shard.finish()

    assert a_writes and writes[len(a_writes):], "a.weight and c.bias went (partly) direct"
    for offset, count in writes:
        assert offset % page == 0 and count % page == 0 and count > 0
    a_head = -shard.offsets["a.weight"] % page  # the bytes before its first page boundary
    assert a_writes == [(shard.offsets["a.weight"] + a_head, (tensors["a.weight"].nbytes - a_head) // page * page)]
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


@pytest.mark.parametrize("error", [errno.EINVAL, errno.EACCES])
def test_a_file_system_without_o_direct_gets_writes_through_the_page_cache(tmp_path, monkeypatch, error):
    """EINVAL (tmpfs before Linux 6.6, some network file systems): every byte goes through the page
    cache, unchanged; any other error names the file."""
    plain_open = shard_file.os.open

    def open_refusing_direct(path, flags, *args):
        if flags & shard_file.os.O_DIRECT:
            raise OSError(error, shard_file.os.strerror(error))
        return plain_open(path, flags, *args)

    monkeypatch.setattr(shard_file.os, "open", open_refusing_direct)
    monkeypatch.setattr(shard_file, "DIRECT_MIN_BYTES", 0)
    tensors = {"a.weight": torch.randn(3 * shard_file.DIRECT_ALIGNMENT).to(fp8.FP8_DTYPE)}
    outputs = [OutputTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    if error != errno.EINVAL:
        with pytest.raises(OSError, match="out.safetensors.partial"):
            ShardFile(tmp_path / "out.safetensors", outputs)
        assert not list(tmp_path.iterdir())  # nothing left behind
        return
    shard = ShardFile(tmp_path / "out.safetensors", outputs)
    assert shard.direct_fd is None
    buffer = torch.empty(tensors["a.weight"].nbytes + shard_file.DIRECT_ALIGNMENT, dtype=torch.uint8)
    lined_up = shard_file.placed(buffer, 0, tensors["a.weight"].nbytes, shard.offsets["a.weight"])
    shard.write("a.weight", lined_up.copy_(tensors["a.weight"].view(torch.uint8)).view(fp8.FP8_DTYPE))
    shard.finish()
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_a_refused_direct_write_falls_back_to_the_page_cache_for_the_rest_of_the_shard(tmp_path, monkeypatch):
    """A file system may open a file for O_DIRECT and then refuse the writes (EINVAL: larger alignment)."""
    refused, direct_fds = [], []
    write_all_at, open_direct = shard_file.write_all_at, shard_file._open_direct

    def recording_open(path):
        direct_fds.append(open_direct(path))
        return direct_fds[-1]

    def refusing_write(fd, offset, view):
        if fd in direct_fds:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        write_all_at(fd, offset, view)

    monkeypatch.setattr(shard_file, "_open_direct", recording_open)
    monkeypatch.setattr(shard_file, "write_all_at", refusing_write)
    monkeypatch.setattr(shard_file, "DIRECT_MIN_BYTES", 0)
    page = shard_file.DIRECT_ALIGNMENT
    tensors = {f"{name}.weight": torch.randn(3 * page + 11).to(fp8.FP8_DTYPE) for name in "ab"}
    shard = ShardFile(tmp_path / "out.safetensors",
                      [OutputTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    if shard.direct_fd is None:
        pytest.skip("the file system of the test folder has no O_DIRECT")
    for name, tensor in tensors.items():
        buffer = torch.empty(tensor.nbytes + page, dtype=torch.uint8)
        lined_up = shard_file.placed(buffer, 0, tensor.nbytes, shard.offsets[name])
        shard.write(name, lined_up.copy_(tensor.view(torch.uint8)).view(fp8.FP8_DTYPE))
    shard.finish()
    assert len(refused) == 1 and not shard.direct  # tried once, then the page cache only
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


# Same-size dtypes in both orders (bf16/f16, fp8/int8/bool) and every width, to pin safetensors' data order.
HEADER_DTYPES = [torch.float32, torch.bfloat16, torch.float16, fp8.FP8_DTYPE, torch.int8, torch.uint8, torch.bool,
                 torch.int64, torch.int32, torch.float64]


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text("abc._0123456789é", min_size=1, max_size=12),
                       st.tuples(st.sampled_from(HEADER_DTYPES), st.lists(st.integers(0, 3), max_size=3)),
                       min_size=1, max_size=12),
       # One key at most: safetensors writes several in hash order, which differs from run to run.
       st.sampled_from([None, {"format": "pt"}, {"note": "x" * 9}]))
def test_header_is_the_serializers_own(specs, metadata):
    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in specs.items()}
    serialized = save(tensors, metadata)
    header = safetensors_header([OutputTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata)
    assert serialized[:len(header)] == header
    assert len(serialized) == len(header) + sum(t.nbytes for t in tensors.values())


class FailingFallocate:
    def __init__(self, error: int):
        self.error = error

    def fallocate(self, *args):
        ctypes.set_errno(self.error)
        return -1


@pytest.mark.parametrize("error", [errno.EOPNOTSUPP, errno.ENOSPC])
def test_allocate_falls_back_to_a_hole_only_where_fallocate_is_unsupported(tmp_path, monkeypatch, error):
    path = tmp_path / "shard"
    monkeypatch.setattr(shard_file, "_libc", FailingFallocate(error))
    with open(path, "wb") as f:
        if error == errno.EOPNOTSUPP:
            shard_file.allocate(f.fileno(), 12345, path)
            assert path.stat().st_size == 12345
        else:
            with pytest.raises(OSError, match="No space left") as raised:
                shard_file.allocate(f.fileno(), 12345, path)
            assert raised.value.filename == str(path)


def test_data_offsets_locate_every_tensor(tiny_checkpoint):
    checkpoint = Checkpoint(tiny_checkpoint("mixtral", max_shard_size="20KB"))
    for file in checkpoint.shard_files:
        infos = {n: i for n, i in checkpoint.tensors.items() if i.file == file}
        offsets = data_offsets(checkpoint.folder / file, {n: i.nbytes for n, i in infos.items()})
        with open(checkpoint.folder / file, "rb") as f:
            for name, info in infos.items():
                read = torch.empty(info.shape, dtype=info.dtype)
                read_into(f.fileno(), offsets[name], read)
                assert torch.equal(read, checkpoint.get(name)), name


def test_writing_behind_or_direct_changes_no_byte(block_friendly, tmp_path, monkeypatch):
    src = block_friendly("mixtral")
    outputs = []
    for how in ("defaults", "every write behind", "every write direct"):
        with monkeypatch.context() as patch:
            if how == "every write behind":
                patch.setattr(shard_file, "DIRECT_MIN_BYTES", 1 << 62)
                patch.setattr(shard_file, "WRITE_BEHIND_MIN_BYTES", 1)
            if how == "every write direct":
                writes = direct_writes(patch)
                patch.setattr(shard_file, "DIRECT_MIN_BYTES", 0)
            dst = tmp_path / how
            quantize_checkpoint(src, dst, Options(max_shard_size=SMALL_SHARDS), workers=2, show_progress=False)
        outputs.append({p.name: p.read_bytes() for p in sorted(dst.iterdir())})
    # The quantized weights were lined up with their place in the shard by the engine, and written direct.
    assert sum(count for _, count in writes) > 0.8 * sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    assert len(outputs[0]) > 3 and outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_output_is_identical_for_any_number_of_workers(tiny_checkpoint, block_friendly, tmp_path, scheme):
    src = block_friendly("mixtral") if scheme == "block" else tiny_checkpoint("mixtral")
    outputs = []
    for workers in (1, 3):
        dst = tmp_path / f"workers-{workers}"
        quantize_checkpoint(src, dst, Options(scheme=scheme, max_shard_size=SMALL_SHARDS), workers=workers,
                            show_progress=False)
        outputs.append(shard_bytes(dst))
    assert len(outputs[0]) > 1 and outputs[0] == outputs[1]


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_channel_and_block_schemes_round_within_fp8(tiny_checkpoint, block_friendly, tmp_path, scheme):
    src = block_friendly("mixtral") if scheme == "block" else tiny_checkpoint("qwen3_moe")
    # compressed-tensors: bf16 scales, which the quantization must use exactly as stored
    summary = quantize_checkpoint(src, tmp_path, Options(scheme=scheme, format="compressed-tensors"),
                                  show_progress=False)
    before, after = Checkpoint(src), Checkpoint(tmp_path)
    for name, decision in summary.plan.decisions.items():
        if decision.quantize:
            w, q = before.get(name), after.get(name)
            scale = after.get(name.removesuffix(".weight") + ".weight_scale")
            assert q.dtype == fp8.FP8_DTYPE and tuple(scale.shape) == SCHEMES[scheme].scale_shape(w.shape)
            cell = SCHEMES[scheme].cell(w.shape)
            full_scale = scale.reshape(fp8.grid_shape(w.shape, cell)).repeat_interleave(cell[0], 0) \
                .repeat_interleave(cell[1], 1)[:w.shape[0], :w.shape[1]]
            error = (SCHEMES[scheme].dequantize(q, scale) - w.float()).abs()
            assert (error <= fp8.rounding_bound(w, full_scale)).all(), name


def test_unknown_device_is_a_user_error(tiny_checkpoint, tmp_path):
    with pytest.raises(UserError, match="--device"):
        quantize_checkpoint(tiny_checkpoint("mixtral"), tmp_path, device="tpu", show_progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--device cuda:0 is not available"):
            quantize_checkpoint(tiny_checkpoint("mixtral"), tmp_path, device="cuda:0", show_progress=False)
