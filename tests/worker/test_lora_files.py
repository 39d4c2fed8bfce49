"""The rules an adapter file passes when the worker reads it (`lora_files.read_adapter`).

Each bad file is refused with its own reason, in words for the client: none names the
file's folder.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import save_file

from diffbatch.worker.lora_files import LoraFileError, LoraFileRules, read_adapter

A, B = "unet.a.lora_A.weight", "unet.a.lora_B.weight"
GOOD = {A: torch.ones(2, 4), B: torch.ones(4, 2)}
RULES = LoraFileRules()


def _save(folder, tensors=GOOD, name="pytorch_lora_weights.safetensors") -> str:
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, name))
    return str(folder)


def _refused(path, rules: LoraFileRules = RULES) -> str:
    with pytest.raises(LoraFileError) as info:
        read_adapter(str(path), rules)
    reason = info.value.reason
    assert "srv_" not in reason and "/" not in reason.replace("/.pt", "")  # no folder, no path
    return reason


def test_a_good_folder_and_file_read_with_a_digest_of_their_bytes(tmp_path) -> None:
    folder = _save(tmp_path / "srv_good")
    weights = read_adapter(folder, RULES)
    assert sorted(weights.tensors) == sorted(GOOD)
    file = os.path.join(folder, "pytorch_lora_weights.safetensors")
    assert read_adapter(file, RULES).digest == weights.digest
    assert weights.digest.startswith("sha256:")
    _save(tmp_path / "srv_good", {**GOOD, "unet.a.lora_B.weight": torch.zeros(4, 2)})
    assert read_adapter(folder, RULES).digest != weights.digest


def test_a_truncated_file_is_refused_as_truncated(tmp_path) -> None:
    folder = _save(tmp_path / "srv_trunc")
    file = os.path.join(folder, "pytorch_lora_weights.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) - 10])
    assert "is truncated" in _refused(folder)


def test_junk_and_an_empty_file_are_refused(tmp_path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(200_000))
    assert "not a safetensors file" in _refused(junk)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    assert "empty" in _refused(empty)


def test_non_finite_and_non_float_tensors_are_refused(tmp_path) -> None:
    nan = _save(tmp_path / "srv_nan", {**GOOD, B: torch.full((4, 2), math.nan)})
    assert _refused(nan).startswith("is not finite: 1 of its 2 tensors")
    inf = _save(tmp_path / "srv_inf", {**GOOD, A: torch.full((2, 4), math.inf)})
    assert "not finite" in _refused(inf)
    ints = _save(tmp_path / "srv_ints", {A: torch.ones(2, 4, dtype=torch.int64)})
    assert "not floating-point" in _refused(ints)


def test_symlinks_out_of_the_folder_and_device_files_are_refused(tmp_path) -> None:
    folder = tmp_path / "srv_links"
    folder.mkdir()
    (folder / "passwd.safetensors").symlink_to("/etc/passwd")
    assert "leads out of its folder" in _refused(folder / "passwd.safetensors")
    (folder / "zero.safetensors").symlink_to("/dev/zero")
    assert "leads out of its folder" in _refused(folder / "zero.safetensors")
    # inside an allowed root (--lora-dir), a device file is still no adapter
    assert "not a regular file" in _refused(folder / "zero.safetensors",
                                            LoraFileRules(roots=("/dev",)))
    # a link that stays inside its folder is fine
    _save(folder / "real")
    (folder / "inside.safetensors").symlink_to(folder / "real" / "pytorch_lora_weights.safetensors")
    assert read_adapter(str(folder / "inside.safetensors"), RULES).tensors


def test_pickle_files_need_the_opt_in(tmp_path) -> None:
    folder = tmp_path / "srv_pickled"
    folder.mkdir()
    torch.save(GOOD, folder / "pytorch_lora_weights.bin")
    assert "pickle" in _refused(folder) and "--lora-allow-pickle" in _refused(folder)
    assert "pickle" in _refused(folder / "pytorch_lora_weights.bin")
    allowed = read_adapter(str(folder), LoraFileRules(allow_pickle=True))
    assert torch.equal(allowed.tensors["unet.a.lora_A.weight"], GOOD["unet.a.lora_A.weight"])
    # weights_only: a pickle that holds more than tensors does not load
    torch.save({"x": object.__new__(LoraFileRules)}, folder / "evil.bin")
    assert "not a readable PyTorch weights file" in _refused(
        folder / "evil.bin", LoraFileRules(allow_pickle=True))


def test_the_size_cap_refuses_a_larger_file(tmp_path) -> None:
    big = _save(tmp_path / "srv_big", {"unet.a.lora_A.weight": torch.ones(600, 600)})
    reason = _refused(big, LoraFileRules(max_bytes=1 << 20))
    assert "larger than this server's limit of 1 MB" in reason
    assert read_adapter(big, LoraFileRules(max_bytes=2 << 20)).tensors


def test_a_folder_without_one_clear_weights_file_is_refused(tmp_path) -> None:
    folder = tmp_path / "srv_two"
    _save(folder, name="a.safetensors")
    _save(folder, name="b.safetensors")
    assert "2 weights files" in _refused(folder)
    (tmp_path / "srv_none").mkdir()
    assert "not a LoRA adapter" in _refused(tmp_path / "srv_none")
