"""Thin FastAPI routes of the OpenAI-compatible server; the logic is in `serving_images.py`.

Each route lists the error statuses it can answer (and only those: `/openapi.json`
must say what the server does), and the image routes are wrapped in
`with_cancellation` so a client disconnect aborts their engine request. A streamed
answer (`stream: true`) leaves the route as a `StreamingResponse`, which ends its
events when the client disconnects, and ending them aborts the request. The edits
route reads its multipart form itself (`uploads.read_edit_form`) before the
cancellable part starts: the disconnect listener reads the same ASGI channel.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from diffbatch.engine.wave_log import DEFAULT_CAPACITY as MAX_WAVES
from diffbatch.entrypoints.openai.errors import error_response, exception_response
from diffbatch.entrypoints.openai.image_store import FILES_ROUTE, MEDIA_TYPES
from diffbatch.entrypoints.openai.middleware import INCOMING_STATE
from diffbatch.entrypoints.openai.protocol import (
    ErrorResponse,
    HealthResponse,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    WaveInfo,
    WaveList,
)
from diffbatch.entrypoints.openai.serving_images import ImageResult
from diffbatch.entrypoints.openai.serving_stream import MEDIA_TYPE as EVENT_STREAM
from diffbatch.entrypoints.openai.serving_stream import EventKind, ImageStream, event_schema
from diffbatch.entrypoints.openai.uploads import EditForm, read_edit_form
from diffbatch.entrypoints.utils import with_cancellation
from diffbatch.errors import DiffbatchError, EngineDeadError

if TYPE_CHECKING:
    from diffbatch.engine.async_engine import Engine
    from diffbatch.entrypoints.openai.middleware import HTTPMetrics
    from diffbatch.entrypoints.openai.serving_images import OpenAIServingImages
    from diffbatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

router = APIRouter()

IMAGES_ROUTE = "/v1/images/generations"
EDITS_ROUTE = "/v1/images/edits"
# The playground: `GET /` serves its page, its CSS and JS are under `PLAYGROUND_PATH`.
STATIC_DIR = Path(__file__).parent / "static"
PLAYGROUND_PATH = "/playground"
# The page loads only its own files and talks only to this server; images are data: URLs
# (results) and blob: URLs (uploads).
_PLAYGROUND_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                   "img-src 'self' data: blob:; media-src blob:; connect-src 'self'; "
                   "form-action 'none'; "
                   "base-uri 'none'; frame-ancestors 'none'")
# Set in the ASGI scope state when an image request is handed to the engine, which
# counts its own refusals from then on; every refusal before that is counted by the
# metrics middleware's hook (`api_server._rejection_counter`).
SUBMITTED_STATE = "diffbatch_submitted"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route that can answer `statuses` (and 503 when the server
    is at its connection limit, which any route can get)."""
    return {status: {"model": ErrorResponse} for status in sorted({*statuses, 503})}


def _image_responses(kind: EventKind, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """`_errors(*statuses)`, and the image routes' 200: JSON, or events with `stream`."""
    return {200: {"content": {EVENT_STREAM: {"schema": event_schema(kind)}},
                  "description": "the images (JSON), or with `stream: true` server-sent "
                  "events: partial images, then the image"}, **_errors(*statuses)}


def _serving(raw_request: Request) -> OpenAIServingImages:
    return raw_request.app.state.serving_images


def _engine(raw_request: Request) -> Engine:
    return raw_request.app.state.engine


@router.post(IMAGES_ROUTE, response_model=ImageGenerationResponse,
             responses=_image_responses("image_generation", 400, 401, 404, 413, 415, 500, 504))
@with_cancellation
async def create_image(request: ImageGenerationRequest, raw_request: Request) -> Response:
    """Generate `n` images for one prompt (OpenAI `images.generate`)."""
    params = _serving(raw_request).prepare_image(request)
    return await _generate(request, params, raw_request, "image_generation")


@router.post(EDITS_ROUTE, response_model=ImageGenerationResponse,
             responses=_image_responses("image_edit", 400, 401, 404, 413, 415, 500, 504))
async def edit_image(raw_request: Request) -> Response:
    """Edit one uploaded image (OpenAI `images.edit`): image-to-image, or inpainting with
    a mask. The multipart request body is declared by `openapi.py`."""
    form = await read_edit_form(raw_request)
    try:
        request = ImageEditRequest.model_validate(form.fields)
    except ValidationError as exc:  # the same 400s as a JSON body's (errors.py)
        raise RequestValidationError(exc.errors()) from None
    return await _run_edit(request=request, form=form, raw_request=raw_request)


@with_cancellation
async def _run_edit(*, request: ImageEditRequest, form: EditForm,
                    raw_request: Request) -> Response:
    params = await _serving(raw_request).prepare_edit(request, form.image, form.mask)
    return await _generate(request, params, raw_request, "image_edit")


async def _generate(request: ImageGenerationRequest, params: SamplingParams,
                    raw_request: Request, kind: EventKind) -> Response:
    """Hand a prepared image request to the engine and answer with its result: JSON, or
    `kind` events for a streamed request."""
    setattr(raw_request.state, SUBMITTED_STATE, True)
    # the engine is told of it now (the add follows at once, with no await between)
    release_incoming = getattr(raw_request.state, INCOMING_STATE, None)
    if release_incoming is not None:
        release_incoming()
    # NOTE: the engine's id is always the server's own: a client's `x-request-id` is
    # echoed and logged, never used as an engine id, or one client could make another's
    # request fail as "already active" by sending the same id.
    request_id = f"img-{uuid.uuid4().hex}"
    client_request_id = raw_request.headers.get("x-request-id")
    serving = _serving(raw_request)
    result: ImageResult | ImageStream | Response
    if request.stream:
        result = await serving.stream(request, params, request_id, client_request_id,
                                      kind=kind)
    else:
        result = await serving.generate(request, params, request_id,
                                        client_request_id=client_request_id,
                                        base_url=str(raw_request.base_url))
    if isinstance(result, ImageStream):
        return StreamingResponse(result.events, media_type=EVENT_STREAM,
                                 headers=result.headers)
    if isinstance(result, ImageResult):
        return JSONResponse(result.response.to_json(), headers=result.headers)
    return result


@router.get("/v1/models", response_model=ModelList, responses=_errors(401))
async def list_models(raw_request: Request) -> ModelList:
    """The served model and its LoRA adapters (each with the model as `parent`), in
    OpenAI's list shape."""
    base = _model_card(raw_request)
    return ModelList(data=[base, *_adapter_cards(raw_request, base)])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=_errors(401, 404))
async def retrieve_model(model: str, raw_request: Request) -> Response:
    """One model (or LoRA adapter) by name (OpenAI `models.retrieve`)."""
    base = _model_card(raw_request)
    for card in (base, *_adapter_cards(raw_request, base)):
        if card.id == model:
            return JSONResponse(card.model_dump())
    return error_response(
        404, f"model {model!r} is not served here; this server serves {base.id!r} "
        "(see GET /v1/models)", param="model", code="model_not_found",
    )


def _model_card(raw_request: Request) -> ModelCard:
    serving = _serving(raw_request)
    return ModelCard(
        id=serving.served_model_name,
        root=getattr(_engine(raw_request).config, "model", None),
        created=raw_request.app.state.started_at,
        diffbatch=serving.model_accepts(),
    )


def _adapter_cards(raw_request: Request, base: ModelCard) -> list[ModelCard]:
    """The LoRA adapters served here (never their paths: `root` is the name)."""
    loras = getattr(_engine(raw_request), "loras", None)
    if loras is None:
        return []
    return [ModelCard(id=name, root=name, parent=base.id, created=base.created)
            for name in loras.names() if name != base.id]


# -- runtime LoRA updates (vLLM's routes; included only with the opt-in flag) ----------
lora_admin_router = APIRouter()


@lora_admin_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                        responses=_errors(400, 401, 404))
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Serve the adapter at `lora_path` under `lora_name` from now on."""
    try:
        await run_in_threadpool(_engine(raw_request).add_lora, request.lora_name,
                                request.lora_path)
    except DiffbatchError as exc:
        return exception_response(exc)
    logger.info("LoRA adapter %r added", request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@lora_admin_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                        responses=_errors(400, 401, 404))
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest,
                              raw_request: Request) -> Response:
    """Stop serving adapter `lora_name` (added at run time or by `--lora-modules`)."""
    if not _engine(raw_request).remove_lora(request.lora_name):
        return error_response(404, f"LoRA adapter {request.lora_name!r} is not served by "
                              "name here (see GET /v1/models)", param="lora_name",
                              code="model_not_found")
    logger.info("LoRA adapter %r removed", request.lora_name)
    return PlainTextResponse(
        f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


@router.get(f"{FILES_ROUTE}/{{file_id}}", response_class=Response, responses={
    200: {"content": {media: {"schema": {"type": "string", "format": "binary"}}
                      for media in MEDIA_TYPES.values()},
          "description": "the image file"},
    **_errors(404)})
async def image_file(file_id: str, raw_request: Request) -> Response:
    """An image made with `response_format: "url"`, for an hour after it was made. The link
    is the credential: no API key is needed."""
    store = _serving(raw_request).image_store
    image = store.get(file_id) if store is not None else None
    if image is None:
        why = ("this server keeps no images (--image-store-mb 0), so it made no links"
               if store is None else
               f"links last {_duration(store.ttl_s)} after the image was made, and the server "
               "forgets them when it restarts or needs the room")
        return error_response(404, f"no such image file: {why}", param="file_id")
    max_age = int(store.seconds_left(image)) if store is not None else 0
    return Response(image.data, media_type=image.media_type,
                    headers={"Cache-Control": f"private, max-age={max_age}"})


def _duration(seconds: float) -> str:
    """"an hour", "90 s", "2 h": how long links last, for messages."""
    if seconds == 3600:
        return "an hour"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds:g} s"


@router.get("/v1/waves", response_model=WaveList, responses=_errors(400, 401))
async def list_waves(
    raw_request: Request,
    after: int = Query(0, ge=0, le=2**63 - 1, description="return waves with a larger id"),
    limit: int = Query(MAX_WAVES, ge=1, le=MAX_WAVES, description="at most this many (the "
                       "newest)"),
) -> Response:
    """The waves run since start-up with an id above `after`, oldest first (the server keeps
    the last few hundred): size, batch key, why each closed, its timings."""
    log = _engine(raw_request).wave_log
    events = log.since(after, limit)
    body = WaveList(data=[WaveInfo(**e.to_dict()) for e in events], last_id=log.last_id)
    return JSONResponse(body.model_dump())


@router.get("/", include_in_schema=False)
async def playground() -> Response:
    """The playground page (static; its script calls this server's API)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                        headers={"Content-Security-Policy": _PLAYGROUND_CSP,
                                 "Cache-Control": "no-cache"})


@router.get("/health", response_model=HealthResponse, responses=_errors())
async def health(raw_request: Request) -> Response:
    """200 while the engine and its worker are alive, 503 otherwise."""
    try:
        # off the event loop: a worker that just died is waited for (its reader
        # thread handles the death), and nothing else should wait meanwhile
        await run_in_threadpool(_engine(raw_request).check_health)
    except DiffbatchError as exc:
        return exception_response(exc)
    except Exception as exc:  # a health check must answer, whatever broke
        logger.warning("health check failed: %r", exc)
        return exception_response(EngineDeadError(f"engine health check failed: {exc!r}"))
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse, responses=_errors())
async def metrics(raw_request: Request) -> Response:
    """Prometheus text: the engine's metrics, then the HTTP layer's."""
    http_metrics: HTTPMetrics = raw_request.app.state.http_metrics
    body = generate_latest(_engine(raw_request).metrics.registry)
    body += generate_latest(http_metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
