"""LoRA adapters of a diffusers pipeline: loaded into PEFT layers, mixed per sample.

`DiffusersLoras` loads an adapter the usual way (diffusers' `load_lora_weights`;
PEFT injection for a pipeline without a loader, e.g. PixArt) into the denoiser and
the text encoders it touches, then hands its weights to the per-sample mixer
(`interception/lora_mixing.py`) and keeps PEFT's own application off: each sample of
a forward adds its own adapters' deltas. A load that fails takes out whatever part
of the adapter did load.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from diffbatch.pipelines.interception.lora_mixing import LoraMixer
from diffbatch.pipelines.interception.rows import RowLayout
from diffbatch.sampling_params import LoraStack

# The components an adapter may touch: the denoiser (rows per image) and the text
# encoders (rows per prompt).
DENOISERS = ("unet", "transformer")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class DiffusersLoras:
    """The LoRA adapters loaded into one diffusers pipeline's modules."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self._loras: dict[str, str] = {}  # adapter name -> its path, or "<tensors>"
        self._mixer: LoraMixer | None = None  # per-sample adapters, from the first load

    def load(self, name: str, weights: str | dict[str, torch.Tensor]) -> int | None:
        """Load the adapter `weights` (a path, or the tensors of one already read and
        checked) under `name`, once per name, into the denoiser and the text encoders
        it touches; each sample of a forward then picks its own adapters (see
        `lora_mixing.py`). Returns the number of layers it touches."""
        source = weights if isinstance(weights, str) else "<tensors>"
        if name in self._loras:
            if self._loras[name] != source:
                raise ValueError(f"LoRA adapter name {name!r} is already loaded")
            return None
        mixer = self._lora_mixer()
        try:
            with warnings.catch_warnings():
                # PEFT warns that a model holding an adapter gets another: the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                if hasattr(self.pipe, "load_lora_weights"):
                    # (a copy: diffusers pops the keys it converts)
                    self.pipe.load_lora_weights(
                        weights if isinstance(weights, str) else dict(weights),
                        adapter_name=name)
                else:  # a pipeline without a loader (PixArt): PEFT into its transformer
                    _inject_lora(self.pipe.transformer, _read_safetensors(weights)
                                 if isinstance(weights, str) else weights, "transformer", name)
            layers = mixer.add(name)
        except Exception:
            # diffusers loads an adapter component by component and cleans up only the
            # one that failed: take out what did load
            mixer.remove(name)
            self._delete_adapter(name)
            raise
        finally:
            self._disable_peft_application()
        self._loras[name] = source
        return layers

    def unload(self, name: str) -> None:
        """Take adapter `name` out of the model (its memory is freed)."""
        if self._loras.pop(name, None) is None:
            return
        self._lora_mixer().remove(name)
        self._delete_adapter(name)

    def check(self, stacks: Sequence[LoraStack]) -> None:
        """Raise `KeyError` if `stacks` name an adapter that is not loaded."""
        if self._mixer is not None:
            self._mixer.check(stacks)
        elif any(stacks):
            raise KeyError("no LoRA adapter is loaded")

    def _lora_mixer(self) -> LoraMixer:
        if self._mixer is None:
            if not hasattr(self.pipe, "load_lora_weights") and \
                    getattr(self.pipe, "transformer", None) is None:
                raise NotImplementedError(
                    f"{type(self.pipe).__name__} does not support LoRA adapters")
            roots: dict[str, tuple[Any, RowLayout]] = {}
            for name in DENOISERS:
                if getattr(self.pipe, name, None) is not None:
                    roots[name] = (getattr(self.pipe, name), "images")
            for name in TEXT_ENCODERS:
                if getattr(self.pipe, name, None) is not None:
                    roots[name] = (getattr(self.pipe, name), "prompts")
            self._mixer = LoraMixer(roots)
        return self._mixer

    def _delete_adapter(self, name: str) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module_name in (*DENOISERS, *TEXT_ENCODERS):
            module = getattr(self.pipe, module_name, None)
            if module is None:
                continue
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer) and name in getattr(layer, "lora_A", {}):
                    with contextlib.suppress(Exception):
                        layer.delete_adapter(name)
            peft_config = getattr(module, "peft_config", None)
            if isinstance(peft_config, dict):
                peft_config.pop(name, None)

    def _disable_peft_application(self) -> None:
        """PEFT's own adapter application stays off: the mixer adds every delta."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module_name in (*DENOISERS, *TEXT_ENCODERS):
            module = getattr(self.pipe, module_name, None)
            if module is None:
                continue
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.enable_adapters(False)



def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors adapter file, or of the one a folder holds
    (`pytorch_lora_weights.safetensors` first, as `save_lora_weights` names it)."""
    from safetensors.torch import load_file

    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError("the adapter folder holds no .safetensors file")
        preferred = "pytorch_lora_weights.safetensors"
        path = os.path.join(path, preferred if preferred in names else names[0])
    return load_file(path)


def _inject_lora(module: Any, state_dict: dict[str, torch.Tensor], prefix: str,
                 name: str) -> None:
    """Load PEFT-format LoRA weights (`<prefix>.<layer>.lora_A.weight`, ...) into
    `module` as adapter `name`, each layer at its own rank (alpha = rank)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    weights = {k[len(prefix) + 1:]: v for k, v in state_dict.items()
               if k.startswith(prefix + ".")}
    ranks = {k.split(".lora_A.")[0]: int(v.shape[0]) for k, v in weights.items()
             if ".lora_A." in k}
    if not ranks or len(weights) != 2 * len(ranks):
        raise ValueError(f"expected PEFT LoRA weights under `{prefix}.` (lora_A/lora_B "
                         f"pairs), got {len(weights)} tensors for {len(ranks)} layers")
    rank = max(ranks.values())
    pattern = {layer: r for layer, r in ranks.items() if r != rank}
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(ranks),
                        rank_pattern=pattern, alpha_pattern=dict(pattern))
    inject_adapter_in_model(config, module, adapter_name=name)
    result = set_peft_model_state_dict(module, weights, adapter_name=name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the adapter has {len(unexpected)} weights this model lacks, "
                         f"e.g. {unexpected[0]!r}")

