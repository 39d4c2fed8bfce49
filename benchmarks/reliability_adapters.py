"""The fault campaign's adapter scenario: hostile LoRA loads against a running server.

Run by `reliability.py` (its 6th scenario) against a server started with
`--allow-runtime-lora-updating`. In one pass, each an HTTP request or two:

- a NUL in `lora_path`: a 400 (`param: "lora_path"`), and the same keep-alive
  connection serves the next request;
- bad adapter files, each refused at `POST /v1/load_lora_adapter` with a 400 naming
  the client's adapter name and the reason, never the server's folder: truncated,
  junk, NaN weights, a wrong shape, keys that match nothing, a pickle file, symlinks
  to /etc/passwd and /dev/zero;
- reload after overwrite: load `m`, generate, unload, overwrite its file with another
  adapter's, load `m` again: the image equals the other adapter's;
- bad stack entries (NaN, 1e30 or string scales; null, numeric or empty names): each a
  400 whose `param` names the field (`lora[1].scale`);
- afterwards a plain request is still served.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import os
import re
import shutil
import tempfile
import time
from typing import Any
from urllib.parse import urlparse

import httpx

ROUTE = "/v1/images/generations"
WEIGHTS = "pytorch_lora_weights.safetensors"
FOLDER_MARK = "srvdir"  # in every server folder name: it must never reach a client
GENERATE = {"prompt": "a red circle", "size": "64x64", "seed": 5, "num_inference_steps": 2}
BAD = {  # change -> what its refusal says
    "truncated": "is truncated",
    "junk": "is not a safetensors file",
    "nan": "is not finite",
    "wrong shape": "does not fit this model",
    "matches nothing": "matches nothing",
    "pickle": "safetensors files only",
    "symlink to /etc/passwd": "leads out of its folder",
    "symlink to /dev/zero": "leads out of its folder",
}
STACKS = [  # a bad stack -> the param its 400 must name
    ([{"name": "x", "scale": math.nan}], "lora[0].scale"),
    ([{"name": "x"}, {"name": "y", "scale": 1e30}], "lora[1].scale"),
    ([{"name": "x", "scale": "0.5"}], "lora[0].scale"),
    ([{"name": None}], "lora[0].name"),
    ([{"name": 3}], "lora[0].name"),
    ([{"name": "x"}, {"name": ""}], "lora[1].name"),
]


def random_unet_lora(model: str, seed: int, rank: int = 4) -> dict[str, Any]:
    """PEFT-format LoRA weights (`unet.<layer>.lora_A/B.weight`) on every attention
    projection of `model`'s UNet, read from its weights file: no pipeline is loaded."""
    import torch
    from safetensors import safe_open

    from diffbatch.pipelines.registry import resolve_model_path

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    file = os.path.join(resolve_model_path(model), "unet", "diffusion_pytorch_model.safetensors")
    with safe_open(file, "pt") as weights:
        for key in weights.keys():  # noqa: SIM118 - safe_open has no __iter__
            layer = key.removesuffix(".weight")
            if not re.search(r"\.attn\d\.to_(q|k|v|out\.0)$", layer):
                continue
            out_features, in_features = weights.get_slice(key).get_shape()
            tensors[f"unet.{layer}.lora_A.weight"] = \
                torch.randn(rank, in_features, generator=generator) * 0.3
            tensors[f"unet.{layer}.lora_B.weight"] = \
                torch.randn(out_features, rank, generator=generator) * 0.3
    return tensors


def make_adapter_files(model: str, root: str) -> dict[str, str]:
    """Two good adapters ("good", "other") and one folder per bad change, in `root`."""
    import torch
    from safetensors.torch import save_file

    folders = {}
    for seed, name in enumerate(("good", "other")):
        folders[name] = os.path.join(root, f"{FOLDER_MARK}-{name}")
        os.makedirs(folders[name])
        save_file(random_unet_lora(model, seed), os.path.join(folders[name], WEIGHTS))
    good = folders["good"]
    tensors = random_unet_lora(model, 0)
    with open(os.path.join(good, WEIGHTS), "rb") as f:
        data = f.read()
    for i, change in enumerate(BAD):
        folder = os.path.join(root, f"{FOLDER_MARK}-{i}")
        os.makedirs(folder)
        target = os.path.join(folder, WEIGHTS)
        first = next(iter(tensors))
        if change == "truncated":
            with open(target, "wb") as f:
                f.write(data[: len(data) // 2])
        elif change == "junk":
            with open(target, "wb") as f:
                f.write(os.urandom(2 << 20))
        elif change == "nan":
            save_file({**tensors, first: torch.full_like(tensors[first], math.nan)}, target)
        elif change == "wrong shape":
            rank, width = tensors[first].shape
            save_file({**tensors, first: torch.ones(rank, width + 3)}, target)
        elif change == "matches nothing":
            save_file({k.replace("attn", "nothing"): v for k, v in tensors.items()}, target)
        elif change == "pickle":
            torch.save(tensors, os.path.join(folder, "pytorch_lora_weights.bin"))
        else:
            os.symlink(change.rpartition(" ")[2], os.path.join(folder, "adapter.safetensors"))
        folders[change] = folder
    return folders


def _image(client: httpx.Client, url: str, model: str) -> Any:
    import numpy as np
    from PIL import Image

    response = client.post(f"{url}{ROUTE}", json={**GENERATE, "model": model}, timeout=120)
    response.raise_for_status()
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)


def _nul_keeps_the_connection(url: str) -> bool:
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", "/v1/load_lora_adapter",
                     json.dumps({"lora_name": "nul", "lora_path": "/tmp/a\u0000b"}),
                     {"content-type": "application/json"})
        first = conn.getresponse()
        param = json.loads(first.read()).get("error", {}).get("param")
        sock = conn.sock
        conn.request("GET", "/health")
        second = conn.getresponse()
        second.read()
        return first.status == 400 and param == "lora_path" and second.status == 200 \
            and conn.sock is sock
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()


def adapters(url: str, args: Any, client: httpx.Client) -> dict[str, Any]:
    """The scenario; returns its row of the campaign's table."""
    root = tempfile.mkdtemp(prefix=f"diffbatch-{FOLDER_MARK}-")
    statuses: list[int] = []
    start = time.monotonic()

    def load(name: str, path: str) -> httpx.Response:
        response = client.post(f"{url}/v1/load_lora_adapter", timeout=120,
                               json={"lora_name": name, "lora_path": path})
        statuses.append(response.status_code)
        return response

    def unload(name: str) -> None:
        statuses.append(client.post(f"{url}/v1/unload_lora_adapter", timeout=60,
                                    json={"lora_name": name}).status_code)

    try:
        folders = make_adapter_files(args.model, root)
        made_s = time.monotonic() - start
        nul_ok = _nul_keeps_the_connection(url)
        statuses.append(400 if nul_ok else 0)
        # bad files: a 400 at load naming the client's name and the reason, no folder
        refused: dict[str, bool] = {}
        leaked = []
        for i, change in enumerate(BAD):
            name = f"client{i}"
            response = load(name, folders[change])
            message = response.json().get("error", {}).get("message", "") \
                if response.status_code == 400 else ""
            refused[change] = response.status_code == 400 and \
                message.startswith(f"LoRA adapter {name!r} ") and BAD[change] in message
            if FOLDER_MARK in response.text or root in response.text:
                leaked.append(change)
        # reload after overwrite
        mutable = os.path.join(root, f"{FOLDER_MARK}-mutable")
        shutil.copytree(folders["good"], mutable)
        load("m", mutable)
        old = _image(client, url, "m")
        unload("m")
        shutil.copy(os.path.join(folders["other"], WEIGHTS), os.path.join(mutable, WEIGHTS))
        load("m", mutable)
        new = _image(client, url, "m")
        load("other", folders["other"])
        wanted = _image(client, url, "other")
        statuses += [200, 200, 200]
        for name in ("m", "other"):
            unload(name)
        old_diff, new_diff = int(abs(old - wanted).max()), int(abs(new - wanted).max())
        # stack fields
        params_ok = 0
        for stack, param in STACKS:
            response = client.post(f"{url}{ROUTE}", timeout=30, headers={
                "content-type": "application/json"},
                content=json.dumps({**GENERATE, "lora": stack}))
            statuses.append(response.status_code)
            params_ok += response.status_code == 400 and \
                response.json()["error"]["param"] == param
        plain = client.post(f"{url}{ROUTE}", json=GENERATE, timeout=120)
        statuses.append(plain.status_code)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    checks = {
        "NUL: 400, connection kept": nul_ok,
        "each bad file refused at load with its reason": all(refused.values()),
        "no server folder in any error": not leaked,
        "reload after overwrite serves the new weights": new_diff == 0 and old_diff > 0,
        "each bad stack field named": params_ok == len(STACKS),
        "served on": plain.status_code == 200,
    }
    answers: dict[str, int] = {}
    for status in statuses:
        answers[str(status)] = answers.get(str(status), 0) + 1
    return {"scenario": "adapters", "requests": len(statuses), "answers": answers,
            "refused": refused, "leaked": leaked, "files_made_s": made_s,
            "figure": f"{sum(refused.values())}/{len(BAD)} bad files refused at load; reload "
                      f"after overwrite: {old_diff} -> {new_diff} levels from the new "
                      f"adapter; {params_ok}/{len(STACKS)} stack fields named",
            "checks": checks}
