"""`diffbatch check-model MODEL`: does a diffusers model batch correctly, and does
each request equal what plain diffusers gives?

The checks a new family must pass before it is listed in docs/models.md, on any
folder, hub id or built-in name, with the model's default size:

- **wave of 4**: four requests of one key (different prompts and seeds) run as one wave;
- **batched == solo**: each of them equals its run alone;
- **mixed**: four requests that mix guidance scales, negative prompts (and none),
  and prompt lengths, submitted together, each equal their runs alone (however the
  engine keys them into waves);
- **solo == diffusers**: a request served alone equals the same call of the plain
  diffusers pipeline (same arguments, `torch.Generator(device).manual_seed(seed)`),
  with and without a negative prompt;
- **step mode**: the mixed requests in step mode equal their request-mode runs, or
  the engine refuses step mode and says why.

Images are compared in levels (0-255, rounded), the unit a user sees; the bar is 1.
The engine runs in this process (`executor="inproc"`), so nothing else is started;
the plain pipeline is a second copy loaded from the same folder, so the model must
fit twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch

# Most levels (0-255) a request's image may differ between two ways of computing it.
MAX_LEVELS = 1
# One key: short prompts (CogView4 pads a wave's prompts: these pad alike).
WAVE_PROMPTS = ("a red cat", "a blue dog", "a green tree", "a white boat")
# Mixed: negative prompts or none, two guidance scales, a long prompt.
LONG_PROMPT = ("a large old castle on a mountain over a dark forest under the night sky "
               "with a bright moon and many stars, a river and a bridge in the valley "
               "below, oil painting, high quality, detailed")
MIXED = (  # (prompt, negative prompt, use the other guidance scale)
    ("a red cat", None, False),
    (LONG_PROMPT, "blurry, bad", False),
    ("a small bird on a tree", None, True),
    ("a dog", "ugly", True),
)


@dataclasses.dataclass
class Check:
    """One check's outcome: `levels` is the largest difference found (None: no
    images compared), `detail` what was compared or why it was skipped."""

    name: str
    ok: bool
    detail: str
    levels: int | None = None


def levels(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest difference of two [n, C, H, W] images in [0, 1], in 0-255 levels."""
    if a.shape != b.shape:
        return 255
    return int(((a.float() * 255).round() - (b.float() * 255).round()).abs().max().item())


def _params(info: Any, seed: int, *, negative: str | None = None, other_guidance: bool = False,
            steps: int, size: tuple[int, int] | None) -> Any:
    from diffbatch import SamplingParams

    guidance = info.default_guidance_scale + (1.5 if other_guidance else 0.0)
    height, width = size or (None, None)
    extra: dict[str, Any] = {}
    if info.negative_prompt == "no":  # the pipeline takes none (LCM, Flux.2 Klein)
        negative = None
    elif info.negative_prompt == "true_cfg" and negative is not None:
        extra["true_cfg_scale"] = 2.0  # Flux uses one only with true CFG
    return SamplingParams(height=height, width=width, num_inference_steps=steps, seed=seed,
                          guidance_scale=guidance, negative_prompt=negative, output_type="pt",
                          extra=extra)


def _compare(name: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> Check:
    worst = max(((levels(a, b), label) for label, a, b in pairs), key=lambda t: t[0])
    return Check(name, worst[0] <= MAX_LEVELS,
                 f"{len(pairs)} request(s); largest difference {worst[0]} level(s) "
                 f"({worst[1]})", worst[0])


def _generate(engine: Any, prompts: list[str], params: list[Any]) -> list[Any]:
    outs = engine.generate(prompts, params, use_tqdm=False)
    failed = [o.error.message for o in outs if not o.ok and o.error is not None]
    if failed or not all(o.ok for o in outs):
        raise RuntimeError(f"a request failed: {failed[0] if failed else 'aborted'}")
    return outs


def _reference_call(pipe: Any, info: Any, prompt: str, params: Any) -> torch.Tensor:
    """The plain diffusers call a user would make for `params`."""
    from diffbatch.pipelines import family_rules

    kwargs: dict[str, Any] = {
        "prompt": prompt, "num_inference_steps": params.num_inference_steps,
        "height": params.height, "width": params.width, "output_type": "pt",
        # the engine seeds a generator on the pipeline's device, `seed + i` for image i
        "generator": torch.Generator(device=pipe.device).manual_seed(params.seed),
    }
    kwargs.update(params.extra)
    if params.negative_prompt is not None:
        kwargs["negative_prompt"] = params.negative_prompt
    if info.uses_guidance_scale:
        kwargs["guidance_scale"] = params.guidance_scale
    # Where diffbatch must differ (docs/models.md): no binning without bins for the
    # transformer's size (the call would raise), nor where it changes the output size.
    if family_rules.resolution_binning(pipe) is False:
        kwargs["use_resolution_binning"] = False
    if "clean_caption" in family_rules.call_params(pipe):
        kwargs["clean_caption"] = False
    with torch.no_grad():
        return pipe(**kwargs).images.detach().to("cpu", torch.float32)


def check_model(model: str, *, steps: int = 2, size: tuple[int, int] | None = None,
                step_mode: bool = True, device: str | None = None) -> list[Check]:
    """Run every check on `model` (a folder, hub id or built-in name); see the module
    docstring. A check that cannot run is reported failed with the reason."""
    from diffbatch import Engine
    from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
    from diffbatch.pipelines.registry import resolve_model_path

    checks: list[Check] = []
    # A wave that fails must fail its requests here, not be re-run one by one.
    engine_args = {"max_num_seqs": 4, "executor": "inproc", "request_batch_max_wait_ms": 0,
                   "batch_error_isolation": "none", "device": device}
    with Engine(model, **engine_args) as engine:
        info = engine.info

        def make(seed: int, **kw: Any) -> Any:
            return _params(info, seed, steps=steps, size=size, **kw)

        # 1. One wave of four, each equal to its run alone.
        wave_params = [make(10 + i) for i in range(4)]
        wave = _generate(engine, list(WAVE_PROMPTS), wave_params)
        sizes = [o.batch_size for o in wave]
        checks.append(Check("wave of 4", sizes == [4] * 4, f"wave sizes {sizes}"))
        solos = [_generate(engine, [p], [q])[0] for p, q in zip(WAVE_PROMPTS, wave_params,
                                                                 strict=True)]
        checks.append(_compare("batched == solo", [
            (f"request {i}", w.images, s.images) for i, (w, s) in enumerate(zip(wave, solos,
                                                                                  strict=True))]))
        # 2. Mixed guidance, negative prompts and prompt lengths, submitted together.
        mixed_prompts = [p for p, _, _ in MIXED]
        mixed_params = [make(20 + i, negative=neg, other_guidance=other)
                        for i, (_, neg, other) in enumerate(MIXED)]
        mixed = _generate(engine, mixed_prompts, mixed_params)
        mixed_solos = [_generate(engine, [p], [q])[0]
                       for p, q in zip(mixed_prompts, mixed_params, strict=True)]
        check = _compare("mixed guidance, negatives, lengths", [
            (f"request {i}", m.images, s.images)
            for i, (m, s) in enumerate(zip(mixed, mixed_solos, strict=True))])
        check.detail += f"; wave sizes {[o.batch_size for o in mixed]}"
        checks.append(check)
        resolved = [engine.resolve_params(q) for q in (wave_params[0], *mixed_params[:2])]
    # 3. Solo == plain diffusers: without a negative prompt, and with one.
    # The diffusers pipeline object itself, called directly; loaded the way the
    # adapter loads it (components the folder leaves out, like SD3's T5, passed as None).
    pipe = DiffusersT2IPipeline.from_pretrained(resolve_model_path(model), device=device).pipe
    references = [
        ("no negative prompt", solos[0].images,
         _reference_call(pipe, info, WAVE_PROMPTS[0], resolved[0])),
        ("negative prompt, long prompt", mixed_solos[1].images,
         _reference_call(pipe, info, mixed_prompts[1], resolved[2])),
    ]
    del pipe
    checks.append(_compare("solo == diffusers", references))
    # 4. Step mode: the mixed requests again, each equal to its request-mode run.
    if step_mode:
        checks.append(_check_step_mode(model, engine_args, mixed_prompts, mixed_params,
                                       mixed_solos))
    return checks


def _check_step_mode(model: str, engine_args: dict[str, Any], prompts: list[str],
                     params: list[Any], solos: list[Any]) -> Check:
    from diffbatch import Engine
    from diffbatch.errors import DiffbatchError

    try:
        engine = Engine(model, **engine_args, step_execution=True, warmup=False)
    except DiffbatchError as exc:  # a clear refusal is an answer too
        return Check("step mode", True, f"refused: {exc.message}")
    with engine:
        outs = _generate(engine, prompts, params)
    return _compare("step mode", [(f"request {i}", o.images, s.images)
                                  for i, (o, s) in enumerate(zip(outs, solos, strict=True))])


# -- command line ------------------------------------------------------------------------
def add_check_model_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-model", help="check that a diffusers model batches correctly and equals "
        "plain diffusers", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("model", help="a diffusers folder, a hub id or a built-in name "
                        "(e.g. tiny-sdxl)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per request")
    parser.add_argument("--size", default=None, metavar="WxH",
                        help="image size (default: the model's default)")
    parser.add_argument("--no-step-mode", action="store_true", help="skip the step-mode check")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error", "critical"))
    parser.set_defaults(func=run_check_model)


def run_check_model(args: argparse.Namespace) -> int:
    """Print one line per check (or JSON); exit code 1 when any failed."""
    size = None
    if args.size:
        width, _, height = args.size.lower().partition("x")
        size = (int(height), int(width))
    checks = check_model(args.model, steps=args.steps, size=size,
                         step_mode=not args.no_step_mode, device=args.device)
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"{'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    return 0 if all(c.ok for c in checks) else 1
