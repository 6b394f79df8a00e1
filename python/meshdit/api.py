"""`meshdit api`: an OpenAI-compatible image and video service on one resident pipeline.

FastAPI + uvicorn in front of one `generate.Engine` (the pipeline in this process, its
transformer on the mesh, a lost rank recovered by relaunching the mesh). Every request is a job
in one FIFO queue run by one worker thread (the thread that also starts the mesh and owns it):

    POST /v1/images/generations   OpenAI's request; answers when the images are made, or streams
                                  server-sent events with "stream": true
    POST /v1/videos               OpenAI's request (JSON or multipart form); answers at once with
                                  the job, which runs in the background
    GET  /v1/videos, /v1/videos/{id}, /v1/videos/{id}/content (the MP4), DELETE /v1/videos/{id}
    GET  /v1/jobs, /v1/jobs/{id}, /v1/jobs/{id}/events (SSE), POST /v1/jobs/{id}/cancel
         (and /v1/videos/{id}/events, /v1/videos/{id}/cancel): any job, image or video
    GET  /v1/models, /health

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, one line naming
the field or limit; an unknown field is an error, never ignored. docs/service.md has the rest.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import hmac
import ipaddress
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .client import MeshditError, ServerError
from .generate import (MAX_INPUT_IMAGES, MAX_SCALE, SIZE_RE, Cancelled, Request, RequestError,
                       _Parser, read_image,
                       add_engine_options, check_engine_args, engine_from_args, image_bytes,
                       plan_line, video_bytes)

MAX_BODY = 1 << 20  # bytes of a request body


@dataclasses.dataclass
class Limits:
    max_n: int = 4
    max_pixels: int = 1536 * 1536
    max_frames: int = 129
    max_steps: int = 100
    max_queue: int = 16  # jobs waiting (the running one not counted)
    keep_jobs: int = 64  # finished jobs kept for GET (the oldest go first)
    header_timeout: int = 20  # seconds a request's line and headers may take to arrive
    body_timeout: int = 60  # seconds a body may take, plus one per body_min_rate bytes come
    body_min_rate: int = 16384  # bytes a second that extend a body's deadline (mod_reqtimeout)
    max_prompt_chars: int = 16384  # a prompt's (and negative prompt's) characters
    max_upload_bytes: int = 32 << 20  # an edit's body (its images); other bodies: 1 MiB


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers  # HTTP headers the status calls for (Retry-After, Allow, ...)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# ---- jobs ------------------------------------------------------------------------------------------
class Job:
    """One request's life: queued -> in_progress -> completed | failed | cancelled. Its events
    (a list, appended by the worker) are what the SSE endpoints send."""

    def __init__(self, kind: str, request: Request, fmt: str = "png", size_text: str = "",
                 extra: dict | None = None):
        self.id = f"{'video' if kind == 'video' else 'img'}_{uuid.uuid4().hex[:24]}"
        self.kind, self.request, self.format = kind, request, fmt
        self.size_text = size_text or f"{request.width}x{request.height}"
        self.extra = extra or {}
        self.status = "queued"
        self.created_at = time.time()
        self.started_at = self.completed_at = None
        self.step, self.steps, self.s_per_step = 0, request.steps, None
        self.queue_position = None
        self.seeds = [request.seed + k for k in range(request.n)]
        self.resumes: list[dict] = []
        self.error: dict | None = None
        self.outputs: list[bytes] | None = None  # PNG/JPEG/WebP per image, or one MP4
        self.result_info: dict = {}
        self.cancel = threading.Event()
        self.events: list[dict] = []
        self.seq: int | None = None  # its place in submission order (Service.submit)
        self._lock = threading.Lock()
        self._waiters: list = []

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    def publish(self, type_: str, **data) -> None:
        ev = {"type": type_, "id": self.id, "created_at": int(time.time()), **data}
        with self._lock:
            self.events.append(ev)
            waiters = list(self._waiters)
        for loop, aev in waiters:
            try:
                loop.call_soon_threadsafe(aev.set)
            except RuntimeError:  # that loop is closed
                pass

    async def wait_events(self, seen: int, timeout: float) -> None:
        """Returns when there are more than `seen` events, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        aev = asyncio.Event()
        entry = (loop, aev)
        with self._lock:
            if len(self.events) > seen:
                return
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(aev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.remove(entry)

    def progress(self) -> int:
        if self.status == "completed":
            return 100
        return int(100 * self.step / self.steps) if self.steps else 0

    def status_object(self) -> dict:
        """The job as /v1/jobs/{id} shows it."""
        return {"id": self.id, "object": "job", "kind": self.kind, "status": self.status,
                "created_at": int(self.created_at),
                "started_at": None if self.started_at is None else int(self.started_at),
                "completed_at": None if self.completed_at is None else int(self.completed_at),
                "queue_position": self.queue_position, "progress": self.progress(),
                "step": self.step, "steps": self.steps, "s_per_step": self.s_per_step,
                "seeds": self.seeds, "size": self.size_text, "n": self.request.n,
                "cancel_requested": self.cancel.is_set() and not self.done,
                "resumes": self.resumes, "error": self.error, **self.result_info}

    def video_object(self, model: str) -> dict:
        """The job as OpenAI's Video object, with meshdit's fields after OpenAI's."""
        r = self.request
        return {"id": self.id, "object": "video", "created_at": int(self.created_at),
                "status": self.status, "model": model, "progress": self.progress(),
                "prompt": r.prompt, "seconds": f"{r.frames / r.fps:g}", "size": self.size_text,
                "completed_at": None if self.completed_at is None else int(self.completed_at),
                "expires_at": None, "remixed_from_video_id": None, "error": self.error,
                "queue_position": self.queue_position, "step": self.step, "steps": self.steps,
                "s_per_step": self.s_per_step, "frames": r.frames, "fps": r.fps,
                "seed": r.seed, "cancel_requested": self.cancel.is_set() and not self.done,
                "resumes": self.resumes,
                **{("generation_seconds" if k == "seconds" else k): v
                   for k, v in self.result_info.items()}}


class Service:
    """The queue and its worker. The worker thread makes the engine (so the mesh's launcher is a
    child of a thread that lives as long as the service) and runs one job at a time."""

    def __init__(self, engine_factory, limits: Limits, model_name: str):
        self.limits, self.model_name = limits, model_name
        self._factory = engine_factory
        self.engine = None
        self.load_error: BaseException | None = None
        self.ready = threading.Event()
        self.jobs: dict[str, Job] = {}
        self._seq = 0  # each job's place in submission order (a list's cursor)
        self._gone: collections.OrderedDict[str, int] = collections.OrderedDict()  # removed: place
        self._queue: collections.deque[Job] = collections.deque()
        self._finished: collections.deque[str] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.running: Job | None = None
        self.completed = 0
        self._thread = threading.Thread(target=self._work, name="meshdit-api-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the queue ---------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._stopping:
                raise ApiError(503, "the service is shutting down", code="shutting_down",
                               type="server_error")
            if self.engine is not None:  # a mesh lost for good takes no more jobs
                ok, why = self.healthy()
                if not ok:
                    raise ApiError(503, why, code="mesh_lost", type="server_error")
            # max_queue jobs may wait behind a running one (0: only an idle service takes one)
            if len(self._queue) >= self.limits.max_queue + (self.running is None):
                raise ApiError(429, f"the queue is full ({self.limits.max_queue} jobs waiting, "
                                    f"--max-queue): try again later", code="queue_full",
                               type="rate_limit_error", headers={"retry-after": "1"})
            self._seq += 1
            job.seq = self._seq
            self.jobs[job.id] = job
            self._queue.append(job)
            job.queue_position = len(self._queue)
            self._cv.notify_all()
        job.publish("queued", queue_position=job.queue_position)
        return job

    def _reposition(self) -> None:
        """Every waiting job learns its new position (called with the lock held)."""
        for i, j in enumerate(self._queue, 1):
            if j.queue_position != i:
                j.queue_position = i
                j.publish("queued", queue_position=i)

    def cancel(self, job: Job) -> Job:
        with self._cv:
            if job.done:
                return job
            job.cancel.set()
            if job in self._queue:
                self._queue.remove(job)
                self._finish(job, "cancelled", step=0)
                self._reposition()
        return job

    def _finish(self, job: Job, status: str, **data) -> None:
        job.status, job.completed_at, job.queue_position = status, time.time(), None
        if status == "completed":
            self.completed += 1
        with job._lock:  # a finished job's previews keep their event, not their image: up to
            for i, ev in enumerate(job.events):  # keep_jobs jobs x every preview of each
                if ev["type"] == "preview" and ev.get("b64_json") is not None:
                    job.events[i] = {**ev, "b64_json": None}
        job.publish(status, **data)
        self._finished.append(job.id)
        while len(self._finished) > self.limits.keep_jobs:
            self._forget(self.jobs.pop(self._finished.popleft(), None))

    def delete(self, job: Job) -> None:
        self.cancel(job)
        with self._cv:
            self._forget(self.jobs.pop(job.id, None))

    def _forget(self, job: Job | None) -> None:
        """A removed job's place is kept a while (4 x --keep-jobs of them), so that a list paged
        `after` it goes on from there."""
        if job is not None:
            self._gone[job.id] = job.seq
            while len(self._gone) > 4 * self.limits.keep_jobs:
                self._gone.popitem(last=False)

    def place(self, job_id: str) -> int | None:
        """The submission place of a job kept or lately removed, else None."""
        job = self.jobs.get(job_id)
        return job.seq if job is not None else self._gone.get(job_id)

    def begin_shutdown(self) -> None:
        """Refuses new jobs, cancels the waiting ones and the running one (between two steps)."""
        with self._cv:
            self._stopping = True
            for job in list(self._queue):
                job.cancel.set()
                self._finish(job, "cancelled", step=0, reason="the service is shutting down")
            self._queue.clear()
            if self.running is not None:
                self.running.cancel.set()
            self._cv.notify_all()

    def shutdown(self, timeout: float | None = None) -> None:
        self.begin_shutdown()
        self._thread.join(timeout)

    # -- the worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported by main
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        break
                    job = self._queue.popleft()
                    self.running = job
                    job.status, job.started_at, job.queue_position = "in_progress", time.time(), 0
                    self._reposition()
                self._run(job)
                with self._cv:
                    self.running = None
        finally:
            self.engine.close()

    def _run(self, job: Job) -> None:
        job.publish("started", steps=job.steps, seeds=job.seeds)

        def on_event(name, **d):
            if name == "step":
                job.step, job.steps, job.s_per_step = d["step"], d["steps"], round(d["s_per_step"], 6)
                job.publish("progress", step=d["step"], steps=d["steps"],
                            seconds=round(d["seconds"], 6), s_per_step=job.s_per_step,
                            eta_seconds=round(d["s_per_step"] * (d["steps"] - d["step"]), 3))
            elif name == "preview":
                for k, img in enumerate(d["images"]):
                    job.publish("preview", step=d["step"], steps=d["steps"], image_index=k,
                                output_format="png",
                                b64_json=base64.b64encode(image_bytes(img, "png")).decode())
            elif name == "resume":
                rec = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}
                job.resumes.append(rec)
                job.publish("resumed", **rec)

        t0 = time.perf_counter()
        try:
            res = self.engine.run(job.request, on_event=on_event, cancel=job.cancel, checked=True)
            if res.kind == "video":
                outputs = [video_bytes(res.frames, res.fps)]
            else:
                outputs = [image_bytes(img, job.format) for img in res.images]
        except Cancelled:
            with self._cv:
                self._finish(job, "cancelled", step=job.step)
            return
        except Exception as e:  # noqa: BLE001 - the job's error, one line
            msg = " ".join(str(e).split()) or type(e).__name__
            # a request the mesh cannot hold (over --max-memory or the node's memory) is the
            # request's failure, not the server's: 400, which clients do not retry
            code = ("over_memory_limit" if _server_code(e) == "MDT_E_NOMEM"
                    else "generation_failed")
            job.error = {"code": code, "message": msg}
            with self._cv:
                self._finish(job, "failed", error=job.error)
            return
        job.outputs = outputs
        job.result_info = {"seconds": round(time.perf_counter() - t0, 6),
                           "pipeline_seconds": round(res.seconds, 6),
                           "queue_seconds": round(job.started_at - job.created_at, 6),
                           "lora": res.loras,
                           "pipeline_kwargs": {k: v for k, v in res.pipeline_kwargs.items()
                                               if k not in ("prompt", "negative_prompt")}}
        with self._cv:
            self._finish(job, "completed")

    # -- lookups -----------------------------------------------------------------------------------
    def get(self, job_id: str, kind: str | None = None) -> Job:
        job = self.jobs.get(job_id)
        if job is None or (kind is not None and job.kind != kind):
            raise ApiError(404, f"no {kind or 'job'} '{job_id}' (finished jobs are kept for the "
                                f"last {self.limits.keep_jobs})", param="id", code="not_found")
        return job

    def healthy(self) -> tuple[bool, str]:
        """(ok, why): not ok once the mesh is gone for good (no resume to start it again)."""
        for t in self.engine.transformers if self.engine else [None]:  # A14B: two meshes
            if t is None or t._client is None:
                return False, "the mesh is gone and could not be started again"
            server = getattr(t, "_server", None)  # None: attached to a server this did not start
            why = server._alive() if server is not None else None
            if why and getattr(t, "resumes", None) is None:  # with resume, a job relaunches it
                return False, f"the mesh is gone ({why}) (--no-resume: it is not started again)"
        return True, "ok"


def _server_code(e: BaseException) -> str | None:
    """The status name (`MDT_E_NOMEM`, ...) of the server's error reply behind `e` (raised from
    the transformer's forward through the pipeline, maybe wrapped), or None."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, ServerError):
            return e.metadata.get("code")
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


# ---- reading requests ------------------------------------------------------------------------------
_OPENAI_UNSUPPORTED = {"background", "moderation", "output_compression", "partial_images",
                       "quality", "style", "user", "input_reference", "remix_video_id"}


def _clip(text, n: int = 60) -> str:
    """Client text quoted in an error: one line (control characters escaped), at most n
    characters and an ellipsis."""
    t = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)[:n + 1])
    return t[:n] + "..." if len(t) > n else t


_FORM_NUMBER = {int: re.compile(r"-?[0-9]+"),  # ASCII digits only: no " 16", "1_6", "+2", "٣"
                float: re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")}


def _field(body: dict, key: str, kind, form: bool = False, default=None):
    """body[key] as `kind` (int, float, str, bool), or default; a wrong type is a 400."""
    if key not in body:
        return default
    v = body[key]
    if v is None:
        return default
    if form and isinstance(v, str) and kind is not str:  # multipart fields are text
        try:
            if kind in (int, float) and not _FORM_NUMBER[kind].fullmatch(v):
                raise ValueError(v)
            v = {int: int, float: float}[kind](v) if kind in (int, float) else \
                {"true": True, "false": False}[v.lower()]
        except (KeyError, ValueError):
            raise ApiError(400, f"'{key}' must be {_KIND[kind]}, got '{_clip(v, 40)}'", param=key,
                           code="invalid_type") from None
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v) if abs(v) <= MAX_SCALE else math.inf  # (float() of a huge int overflows)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ApiError(400, f"'{key}' must be {_KIND[kind]}, got {json.dumps(v)[:40]}",
                       param=key, code="invalid_type")
    if kind is float and not (math.isfinite(v) and abs(v) <= MAX_SCALE):
        # NaN, Infinity (JSON extensions Python reads) and absurd magnitudes: never a job
        raise ApiError(400, f"'{key}' must be a finite number of magnitude at most "
                            f"{MAX_SCALE:g}, got {str(body[key])[:40]}", param=key,
                       code="invalid_value")
    if kind is str:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"'{key}' must be valid Unicode text (a lone surrogate at "
                                f"character {e.start})", param=key, code="invalid_value") from None
    return v


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _check_keys(body: dict, allowed: set, where: str) -> None:
    for k in body:
        if k in allowed:
            continue
        if k in _OPENAI_UNSUPPORTED:
            raise ApiError(400, f"'{k}' is an OpenAI field that meshdit does not implement",
                           param=k, code="unsupported_parameter")
        raise ApiError(400, f"unknown field '{_clip(k)}' for {where} (known: "
                            f"{', '.join(sorted(allowed))})", param=_clip(k), code="unknown_parameter")


def _parse_size(text: str | None) -> tuple[int | None, int | None]:
    if text is None or text == "auto":
        return None, None
    m = SIZE_RE.fullmatch(text.lower())  # ASCII digits only: no "+64", " 64", "1_6", "６４"
    if m is None:
        raise ApiError(400, f"size '{_clip(text, 40)}' is not WIDTHxHEIGHT (e.g. 1024x1024) or "
                            f"'auto'", param="size", code="invalid_size")
    if len(m[1]) > 9 or len(m[2]) > 9:  # (int() refuses past 4300 digits: never a 500)
        raise ApiError(400, f"size '{_clip(text, 40)}': a side of more than 9 digits",
                       param="size", code="invalid_size")
    w, h = int(m[1]), int(m[2])
    if w < 1 or h < 1:
        raise ApiError(400, f"size '{_clip(text, 40)}': width and height must be positive",
                       param="size", code="invalid_size")
    return w, h


IMAGE_FIELDS = {"prompt", "model", "n", "size", "response_format", "output_format", "stream",
                "negative_prompt", "steps", "guidance", "true_cfg", "seed",
                "max_sequence_length", "preview_every", "lora"}
EDIT_FIELDS = IMAGE_FIELDS | {"strength"}  # and the files: image (image[]), mask
VIDEO_FIELDS = {"prompt", "model", "seconds", "size", "negative_prompt", "steps", "guidance",
                "seed", "frames", "fps", "max_sequence_length", "preview_every", "lora"}


def _common(body: dict, form: bool, limits: Limits) -> dict:
    for key in ("prompt", "negative_prompt"):  # the tokenizers read all of it before they cut it
        v = body.get(key)
        if isinstance(v, str) and len(v) > limits.max_prompt_chars:
            raise ApiError(400, f"'{key}' has {len(v):,} characters, over the limit of "
                                f"{limits.max_prompt_chars:,} (--max-prompt-chars)", param=key,
                           code="invalid_value")
    lora = body.get("lora")
    if lora is not None and not isinstance(lora, dict):  # a form's text included
        raise ApiError(400, "'lora' must be an object of adapter name: weight (JSON)",
                       param="lora", code="invalid_type")
    return dict(loras=lora, prompt=_field(body, "prompt", str, form),
                negative_prompt=_field(body, "negative_prompt", str, form),
                steps=_field(body, "steps", int, form), guidance=_field(body, "guidance", float, form),
                seed=_field(body, "seed", int, form),
                max_sequence_length=_field(body, "max_sequence_length", int, form),
                preview_every=_field(body, "preview_every", int, form, 0))


def _check_model(svc: Service, body: dict, form: bool) -> None:
    m = _field(body, "model", str, form)
    if m is not None and m != svc.model_name:
        raise ApiError(404, f"model '{_clip(m)}' is not served here; this service runs "
                            f"'{svc.model_name}'", param="model", code="model_not_found")


def _engine_check(svc: Service, req: Request) -> Request:
    lim = svc.limits
    try:
        return svc.engine.check(req, max_pixels=lim.max_pixels, max_frames=lim.max_frames,
                                max_steps=lim.max_steps, max_n=lim.max_n)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


def image_job(svc: Service, body: dict, form: bool = False, images: list | None = None,
              mask=None) -> tuple[Job, bool]:
    """A generation (JSON), or an edit (`images`, maybe `mask`: a multipart form's files)."""
    edit = images is not None
    _check_keys(body, EDIT_FIELDS if edit else IMAGE_FIELDS,
                f"POST /v1/images/{'edits' if edit else 'generations'}")
    _check_model(svc, body, form)
    if svc.engine.kind != "image":
        raise ApiError(400, f"this service runs {svc.engine.class_name}, which makes videos: "
                            f"use POST /v1/videos", code="wrong_endpoint")
    c = _common(body, form, svc.limits)
    if c["prompt"] is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    rf = _field(body, "response_format", str, form, "b64_json")
    if rf != "b64_json":
        raise ApiError(400, f"response_format '{rf}': meshdit answers with b64_json only (it "
                            f"keeps no files to link to)", param="response_format",
                       code="unsupported_value")
    fmt = _field(body, "output_format", str, form, "png")
    if fmt not in ("png", "jpeg", "webp"):
        raise ApiError(400, f"output_format '{fmt}': png, jpeg or webp", param="output_format",
                       code="unsupported_value")
    n = _field(body, "n", int, form, 1)
    if not 1 <= n <= svc.limits.max_n:
        raise ApiError(400, f"n {n}: must be 1 to {svc.limits.max_n} (--max-n)", param="n",
                       code="invalid_value")
    size = _field(body, "size", str, form)
    w, h = _parse_size(size)
    req = _engine_check(svc, Request(width=w, height=h, n=n,
                                     true_cfg=_field(body, "true_cfg", float, form),
                                     images=images, mask=mask,
                                     strength=_field(body, "strength", float, form), **c))
    stream = _field(body, "stream", bool, form, False)
    return Job("image", req, fmt, f"{req.width}x{req.height}"), stream


def video_job(svc: Service, body: dict, form: bool) -> Job:
    _check_keys(body, VIDEO_FIELDS, "POST /v1/videos")
    _check_model(svc, body, form)
    if svc.engine.kind != "video":
        raise ApiError(400, f"this service runs {svc.engine.class_name}, which makes images: "
                            f"use POST /v1/images/generations", code="wrong_endpoint")
    c = _common(body, form, svc.limits)
    if c["prompt"] is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    fps = _field(body, "fps", int, form, 16)
    frames = _field(body, "frames", int, form)
    seconds = body.get("seconds")
    if seconds is not None:
        if frames is not None:
            raise ApiError(400, "give 'seconds' or 'frames', not both", param="seconds",
                           code="invalid_value")
        try:  # a number, or its text in ASCII digits (OpenAI's client sends "4")
            if isinstance(seconds, bool) or (isinstance(seconds, str) and
                                             not _FORM_NUMBER[float].fullmatch(seconds)):
                raise ValueError(seconds)
            secs = float(seconds)
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, f"'seconds' must be a number, got {_clip(json.dumps(seconds), 40)}",
                           param="seconds", code="invalid_type") from None
        if not 0 < secs <= 3600 or not 1 <= fps <= 240:
            raise ApiError(400, f"seconds {secs:g} at fps {fps}: out of range", param="seconds",
                           code="invalid_value")
        tm = svc.engine.defaults["frame_multiple"]
        frames = max(0, round((secs * fps - 1) / tm)) * tm + 1  # the nearest tm*k + 1 frames
    w, h = _parse_size(_field(body, "size", str, form))
    req = _engine_check(svc, Request(width=w, height=h, frames=frames, fps=fps, **c))
    return Job("video", req, "mp4", f"{req.width}x{req.height}")


async def _disconnected(request) -> bool:
    """True once the client has closed its connection. The body is read, so what the server
    sends next is http.disconnect; this waits for it (polling is_disconnected() never sees it:
    it does not wait, and uvicorn reads the socket again only while a receive() waits). False
    for anything unexpected: never a reason to cancel."""
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return True
    except Exception:  # noqa: BLE001 - see above
        return False


def _gone() -> ApiError:
    """A client that closed its connection mid-body: an answer nobody reads, no traceback."""
    return ApiError(499, "the client closed the connection before the body was complete",
                    code="client_disconnected")


async def _read_bounded(request, limits: Limits, most: int = MAX_BODY) -> bytes:
    """The whole body, refused (413) past MAX_BODY whether its length is announced or not, and
    (408) when it has not all arrived body_timeout seconds after the headers plus a second for
    every body_min_rate bytes that came (Apache mod_reqtimeout's body=T,MinRate=R): a client
    that sends half a body, or a chunked one that never ends, does not hold its connection for
    good, and a slow link at the minimum rate or more gets a body of any allowed size through."""
    timeout, min_rate = limits.body_timeout, limits.body_min_rate
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > most:
        raise ApiError(413, f"the body is {int(size):,} bytes, over the limit of {most:,}",
                       code="body_too_large")
    chunks, got = [], 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    parts = request.stream().__aiter__()
    try:
        while True:  # a chunked body: stopped once past the limit
            try:
                chunk = await asyncio.wait_for(parts.__anext__(),
                                               max(0.0, deadline + got / min_rate - loop.time()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise ApiError(408, f"the body did not arrive within {timeout:g} s and a second "
                                    f"per {min_rate:g} bytes (--body-timeout, --body-min-rate; "
                                    f"{got:,} bytes came)", code="body_timeout") from None
            got += len(chunk)
            if got > most:
                raise ApiError(413, f"the body is over the limit of {most:,} bytes",
                               code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise _gone() from None
    return b"".join(chunks)


def _no_twice(pairs: list) -> dict:
    """A JSON object whose keys are all different (json.loads keeps the last of a repeated one,
    silently: a form that repeats a field is refused, so is this)."""
    body = {}
    for k, v in pairs:
        if k in body:
            raise ApiError(400, f"'{_clip(k)}' given twice", param=_clip(k), code="invalid_value")
        body[k] = v
    return body


async def _read_json(request, limits: Limits) -> dict:
    raw = await _read_bounded(request, limits)
    try:
        body = json.loads(raw, object_pairs_hook=_no_twice)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({_clip(e, 120)})",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON for this service: nested too deeply",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _form_text(body: dict, k: str, v: str, raw: bytes, ctype: str) -> None:
    """A form's text field into body: once, and valid UTF-8."""
    if k in body:
        raise ApiError(400, f"'{_clip(k)}' given twice", param=_clip(k), code="invalid_value")
    # bytes that are not UTF-8: the urlencoded parser replaces them (and the client sent no
    # U+FFFD), the multipart one reads them as Latin-1 (the UTF-8 text is not there)
    replaced = "\ufffd" in k + v and b"\xef\xbf\xbd" not in raw and b"%EF%BF%BD" not in raw.upper()
    if replaced or (ctype.startswith("multipart/") and v.encode("utf-8", "replace") not in raw):
        raise ApiError(400, f"'{_clip(k)}': not valid UTF-8", param=_clip(k), code="invalid_value")
    body[k] = v


def _whole_multipart(ctype: str, raw: bytes) -> None:
    """A multipart body that ends before its closing boundary is refused: the parser takes it,
    and drops the part that was cut off (a strength, the image) without a word."""
    m = re.search(r"boundary=(?:\"([^\"]+)\"|([^;\s]+))", ctype, re.I)
    end = b"--" + (m.group(1) or m.group(2)).encode("latin-1") + b"--" if m else None
    if end is None or not raw.rstrip(b"\r\n").endswith(end):
        raise ApiError(400, "the multipart body is incomplete: it does not end with its closing "
                            "boundary", code="invalid_multipart")


async def _read_edit(request, limits: Limits) -> tuple[dict, list, Any]:
    """OpenAI's edit request: a multipart form with the input image(s) as files (`image`, or
    `image[]` repeated, as the openai client sends a list), an optional `mask` file (its
    transparent pixels are the area to edit) and the text fields. The body may be up to
    --max-upload-bytes. (body, images, mask) as PIL images; 400 naming what is not one."""
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise ApiError(400, "POST /v1/images/edits takes multipart/form-data with the image as a "
                            "file (as OpenAI's)", code="invalid_content_type")
    raw = await _read_bounded(request, limits, limits.max_upload_bytes)
    _whole_multipart(ctype, raw)

    async def replay():
        return {"type": "http.request", "body": raw, "more_body": False}
    form = await HTTPRequest(request.scope, receive=replay).form(
        max_files=MAX_INPUT_IMAGES + 2, max_fields=64)
    body, images, mask = {}, [], None
    if sum(k in ("image", "image[]") for k in form.keys()) > MAX_INPUT_IMAGES:  # before decoding
        raise ApiError(400, f"more than {MAX_INPUT_IMAGES} input images", param="image",
                       code="invalid_value")
    for k, v in form.multi_items():
        if k in ("image", "image[]", "mask"):
            if isinstance(v, str):
                raise ApiError(400, f"'{k}' must be a file (a multipart upload)", param=k,
                               code="invalid_type")
            if k == "mask" and mask is not None:
                raise ApiError(400, "'mask' given twice", param="mask", code="invalid_value")
            if k != "mask" and len(images) == MAX_INPUT_IMAGES:
                raise ApiError(400, f"more than {MAX_INPUT_IMAGES} input images", param="image",
                               code="invalid_value")
            try:  # decoded away from the event loop, its size checked before
                pic = await asyncio.get_running_loop().run_in_executor(
                    None, read_image, await v.read(), "L" if k == "mask" else "RGB",
                    f"'{k}' {_clip(v.filename or '', 40)!r}", 4 * limits.max_pixels)
            except MeshditError as e:
                raise ApiError(400, str(e).removeprefix("meshdit: "), param=k.rstrip("[]"),
                               code="invalid_image") from None
            if k == "mask":
                mask = pic
            else:
                images.append(pic)
        elif not isinstance(v, str):
            raise ApiError(400, f"'{_clip(k)}': a file where text is expected (files: image, "
                                f"image[], mask)", param=_clip(k), code="unsupported_parameter")
        else:
            _form_text(body, k, v, raw, ctype)
    if not images:
        raise ApiError(400, "'image' is required: the picture to edit, as a file", param="image",
                       code="missing_required_parameter")
    return body, images, mask


async def _read_body(request, limits: Limits) -> tuple[dict, bool]:
    """JSON, or a multipart / urlencoded form (what OpenAI's client sends to /v1/videos)."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raw = await _read_bounded(request, limits)  # a chunked form too: at most MAX_BODY
        if ctype.startswith("multipart/form-data"):
            _whole_multipart(ctype, raw)
        if ctype.startswith("application/x-www-form-urlencoded") and not raw.isascii():
            raise ApiError(400, "a urlencoded form must be ASCII (other bytes percent-encoded as "
                                "UTF-8)", code="invalid_value")

        async def replay():  # the bounded bytes, handed to Starlette's form parser
            return {"type": "http.request", "body": raw, "more_body": False}

        # one file parsed (at most MAX_BODY), so that an upload is answered as such below
        form = await HTTPRequest(request.scope, receive=replay).form(max_files=1, max_fields=64)
        body = {}
        for k, v in form.multi_items():
            if not isinstance(v, str):
                raise ApiError(400, f"'{k}': file uploads are not supported", param=k,
                               code="unsupported_parameter")
            _form_text(body, k, v, raw, ctype)
        return body, True
    return await _read_json(request, limits), False


# ---- the app ---------------------------------------------------------------------------------------
def _sse(ev: dict, name: str | None = None) -> str:
    return f"event: {name or ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"


def create_app(svc: Service, api_key: str | None = None):
    # redirect_slashes=False: '/v1/images/generations/' is an unknown path (404), not a 307 to a
    # URL built from the client's Host header
    app = FastAPI(title="meshdit api", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):  # a body not read to its end: the connection ends
        headers = dict(e.headers or {})
        if e.status in (408, 413):
            headers["connection"] = "close"
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):  # unknown path, wrong method
        msg = {404: f"no endpoint {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(
            e.status_code, "invalid_request" if e.status_code == 400 else "http_error")
        return JSONResponse(ApiError(e.status_code, _clip(msg, 200), code=code).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        line = " ".join(str(e).split()) or type(e).__name__
        return JSONResponse(ApiError(500, line, type="server_error", code="internal_error").body(),
                            status_code=500)

    def _refusal(request: HTTPRequest):
        """The key first (nothing else is said to a client without it), then no query parameter
        skipped unread: the answer that stops the request, or None."""
        path = request.url.path
        if path == "/health":  # no key; a health checker's cache-busting query is not read
            return None
        if api_key is not None:
            scheme, _, got = request.headers.get("authorization", "").partition(" ")
            # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    got.strip().encode("utf-8", "surrogateescape"), api_key.encode()):
                return JSONResponse(ApiError(401, "missing or wrong API key: send "
                                                  "'Authorization: Bearer KEY'",
                                             code="invalid_api_key").body(), status_code=401,
                                    headers={"www-authenticate": "Bearer"})
        allowed = ({"variant"} if path.startswith("/v1/videos/") and path.endswith("/content")
                   else {"after", "limit", "order"} if path == "/v1/videos" and
                   request.method == "GET" else set())
        for k in request.query_params.keys():
            why, code = (("unknown query parameter", "unknown_parameter") if k not in allowed else
                         ("query parameter given twice", "invalid_value")
                         if len(request.query_params.getlist(k)) > 1 else (None, None))
            if why:
                return JSONResponse(ApiError(400, f"{why} '{_clip(k)}' for {request.method} "
                                                  f"{_clip(path)}", param=_clip(k),
                                             code=code).body(), status_code=400)
        return None

    class _Gate:
        """_refusal as a plain ASGI middleware: Starlette's BaseHTTPMiddleware (what
        @app.middleware makes) wraps each request in a task of its own, whose cancellation at a
        forced shutdown (a second SIGINT) was logged as a 27-line CancelledError traceback."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                refused = _refusal(HTTPRequest(scope))
                if refused is not None:
                    return await refused(scope, receive, send)
            return await self.inner(scope, receive, send)

    app.add_middleware(_Gate)

    def model_object() -> dict:
        e = svc.engine
        return {"id": svc.model_name, "object": "model", "created": int(e.created),
                "owned_by": "meshdit", "pipeline": e.class_name, "kind": e.kind,
                "family": e.transformer.info.get("family"),
                "layout": {k: int(e.transformer.info.get(k, 1))
                           for k in ("cfg", "tp", "ring", "ulysses")},
                "loras": getattr(e, "loras", []), "cache": getattr(e, "cache", None),
                "device": e.transformer.info.get("device"), "dtype": e.transformer.info.get("dtype"),
                "defaults": {k: v for k, v in e.defaults.items() if k != "max_sequence_length"},
                "limits": dataclasses.asdict(svc.limits)}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        ok, why = svc.healthy()
        body = {"status": "ok" if ok else "error", "model": svc.model_name,
                "queue": len(svc._queue), "running": svc.running.id if svc.running else None,
                "completed": svc.completed,
                "resumes": sum(len(getattr(t, "resumes", []) or [])
                               for t in svc.engine.transformers)}
        if not ok:
            body["error"] = why
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.model_name:
            raise ApiError(404, f"model '{model_id}' is not served here; this service runs "
                                f"'{svc.model_name}'", param="model", code="model_not_found")
        return model_object()

    # -- images ----------------------------------------------------------------------------------
    @app.post("/v1/images/edits")
    async def edits(request: HTTPRequest):
        body, pics, mask = await _read_edit(request, svc.limits)
        job, stream = image_job(svc, body, form=True, images=pics, mask=mask)
        return await _answer(request, job, stream)

    @app.post("/v1/images/generations")
    async def images(request: HTTPRequest):
        body = await _read_json(request, svc.limits)
        job, stream = image_job(svc, body)
        return await _answer(request, job, stream)

    async def _answer(request, job: Job, stream: bool):
        """An image job submitted and answered: streamed, or once it is done."""
        svc.submit(job)
        if stream:
            return StreamingResponse(_image_stream(job), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-meshdit-job": job.id})
        seen = 0
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while not job.done:  # a client that goes away cancels its job
                await job.wait_events(seen, 0.5)
                seen = len(job.events)
                if not job.done and gone.done() and not gone.cancelled() and gone.result():
                    svc.cancel(job)
                    return Response(status_code=499)
        except asyncio.CancelledError:  # uvicorn's forced exit (a second signal): answered,
            svc.cancel(job)  # not logged as a traceback and a 500
            return JSONResponse(ApiError(503, f"job {job.id} was cancelled: the service is "
                                              f"shutting down", code="shutting_down",
                                         type="server_error").body(), status_code=503)
        finally:
            gone.cancel()
        return _image_response(job)

    def _job_error(job: Job) -> ApiError | None:
        """What a failed or cancelled job answers, streamed or not (None: it completed)."""
        if job.status == "cancelled":
            if svc._stopping:
                return ApiError(503, f"job {job.id} was cancelled: the service is shutting down",
                                code="shutting_down", type="server_error")
            return ApiError(409, f"job {job.id} was cancelled", code="cancelled")
        if job.status == "failed":
            if job.error["code"] == "over_memory_limit":
                return ApiError(400, job.error["message"], code="over_memory_limit")
            return ApiError(500, job.error["message"], code="generation_failed",
                            type="server_error")
        return None

    def _image_response(job: Job):
        err = _job_error(job)
        if err is not None:
            raise err
        data = [{"b64_json": base64.b64encode(b).decode(), "seed": s}
                for b, s in zip(job.outputs, job.seeds)]
        job.outputs = None  # delivered: the bytes are not kept
        return {"created": int(job.completed_at), "data": data, "output_format": job.format,
                "size": job.size_text, "meshdit": job.status_object()}

    async def _image_stream(job: Job):
        """OpenAI's image stream events (partial_image for previews, completed per image) and
        meshdit's own (queued, started, progress, resumed) in between."""
        seen, finished = 0, False
        partials = collections.Counter()  # previews sent so far, per image of the batch
        kind = "image_edit" if job.request.images else "image_generation"  # OpenAI's names
        try:
            while True:
                await job.wait_events(seen, 15.0)
                if len(job.events) == seen:
                    yield ": keep-alive\n\n"
                    continue
                for ev in job.events[seen:]:
                    seen += 1
                    t = ev["type"]
                    if t == "preview" and ev["b64_json"] is None:
                        continue  # the job had finished before this stream sent it
                    if t == "preview":
                        yield _sse({"type": f"{kind}.partial_image", "id": job.id,
                                    "b64_json": ev["b64_json"], "created_at": ev["created_at"],
                                    "size": job.size_text, "output_format": "png",
                                    "background": "opaque", "quality": "auto",
                                    "partial_image_index": partials[ev["image_index"]],
                                    "image_index": ev["image_index"], "step": ev["step"],
                                    "steps": ev["steps"]})
                        partials[ev["image_index"]] += 1
                    elif t == "completed":
                        for k, (b, s) in enumerate(zip(job.outputs, job.seeds)):
                            yield _sse({"type": f"{kind}.completed", "id": job.id,
                                        "b64_json": base64.b64encode(b).decode(),
                                        "created_at": ev["created_at"], "size": job.size_text,
                                        "output_format": job.format, "background": "opaque",
                                        "quality": "auto", "image_index": k, "seed": s,
                                        "meshdit": job.status_object()})
                        job.outputs = None
                        finished = True
                        return
                    elif t in ("failed", "cancelled"):
                        finished = True
                        yield _sse({**_job_error(job).body(), "type": f"{kind}.{t}",
                                    "id": job.id})
                        return
                    else:
                        yield _sse({**ev, "type": f"{kind}.{t}"})
        finally:
            if not finished:  # the client left: its job is not wanted any more
                svc.cancel(job)

    # -- videos ----------------------------------------------------------------------------------
    @app.post("/v1/videos")
    async def create_video(request: HTTPRequest):
        body, form = await _read_body(request, svc.limits)
        job = svc.submit(video_job(svc, body, form))
        return job.video_object(svc.model_name)

    @app.get("/v1/videos")
    async def list_videos(request: HTTPRequest):
        """OpenAI's list: newest first (order=desc) or oldest first (asc), `limit` (1 to 100,
        default 20) videos after the one `after` names; `has_more` and `last_id` page on (what
        the openai client does when it iterates)."""
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order '{_clip(order, 20)}': asc or desc", param="order",
                           code="invalid_value")
        limit = q.get("limit", "20")
        if not (_FORM_NUMBER[int].fullmatch(limit) and len(limit) <= 4 and 1 <= int(limit) <= 100):
            raise ApiError(400, f"limit '{_clip(limit, 20)}': an integer from 1 to 100",
                           param="limit", code="invalid_value")
        jobs = [j for j in list(svc.jobs.values()) if j.kind == "video"]  # oldest first
        if order == "desc":
            jobs.reverse()
        if "after" in q:  # by its place: a video deleted or expired since still names one
            at = svc.place(q["after"])
            if at is None:
                raise ApiError(404, f"no video '{_clip(q['after'])}' to list after (finished jobs "
                                    f"are kept for the last {svc.limits.keep_jobs})",
                               param="after", code="not_found")
            jobs = [j for j in jobs if (j.seq > at if order == "asc" else j.seq < at)]
        page = jobs[:int(limit)]
        return {"object": "list", "data": [j.video_object(svc.model_name) for j in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": len(jobs) > len(page)}

    @app.get("/v1/videos/{job_id}")
    async def get_video(job_id: str):
        return svc.get(job_id, "video").video_object(svc.model_name)

    @app.get("/v1/videos/{job_id}/content")
    async def video_content(job_id: str, variant: str = "video"):
        job = svc.get(job_id, "video")
        if variant != "video":
            raise ApiError(400, f"variant '{variant}': meshdit keeps the video only",
                           param="variant", code="unsupported_value")
        if job.status != "completed":
            raise ApiError(409, f"video {job.id} is {job.status}, not completed",
                           code="video_not_ready")
        return Response(job.outputs[0], media_type="video/mp4")

    @app.delete("/v1/videos/{job_id}")
    async def delete_video(job_id: str):
        job = svc.get(job_id, "video")
        svc.delete(job)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/{job_id}/cancel")
    async def cancel_video(job_id: str):
        return svc.cancel(svc.get(job_id, "video")).video_object(svc.model_name)

    @app.get("/v1/videos/{job_id}/events")
    async def video_events(job_id: str):
        return _events(svc.get(job_id, "video"))

    # -- any job ---------------------------------------------------------------------------------
    @app.get("/v1/jobs")
    async def list_jobs():
        return {"object": "list", "data": [j.status_object() for j in list(svc.jobs.values())]}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str):
        return svc.get(job_id).status_object()

    @app.post("/v1/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str):
        return svc.cancel(svc.get(job_id)).status_object()

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str):
        return _events(svc.get(job_id))

    def _events(job: Job):
        async def gen():
            seen = 0
            while True:
                await job.wait_events(seen, 15.0)
                if len(job.events) == seen:
                    if job.done:
                        return
                    yield ": keep-alive\n\n"
                    continue
                for ev in job.events[seen:]:
                    seen += 1
                    yield _sse({**ev, "type": f"job.{ev['type']}"})
                if job.done and seen == len(job.events):
                    return
        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    return app


# ---- the command -----------------------------------------------------------------------------------
def _head_deadline_protocol(seconds: float, send_seconds: float):
    """uvicorn's h11 protocol with a deadline on each request's line and headers: counted from
    the connection's start for its first request, and from the first byte of each later one
    (between requests the keep-alive timeout applies). A client that sends half a header and
    stalls is closed then; uvicorn alone waits for it for good, so a few hundred such sockets
    held the service's file descriptors (nginx's client_header_timeout, Apache's
    RequestReadTimeout header=). And one on the client's reading: a connection whose responses
    wait unread (the transport's buffer over its high-water mark) for `send_seconds` without
    draining is dropped (nginx's send_timeout): a client that sends requests and never reads
    the answers would hold it for good too."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def _cancelled(timer):
        if timer is not None:
            timer.cancel()
        return None

    class HeadDeadline(H11Protocol):
        _head_timer = None
        _head_of = None  # the request cycle under way when the deadline was armed

        def _arm_head(self) -> None:
            self._head_of = self.cycle
            self._head_timer = self.loop.call_later(seconds, self._head_expired)

        def _disarm_head(self) -> None:
            self._head_timer = _cancelled(self._head_timer)

        def _head_expired(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()  # no request yet: nobody to answer

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head()  # the first byte of a next request
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_of:
                self._disarm_head()  # its headers are in: the body has --body-timeout

        _send_timer = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(send_seconds, self._send_expired)

        def resume_writing(self) -> None:
            self._send_timer = _cancelled(self._send_timer)
            super().resume_writing()

        def _send_expired(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing() or self.transport.get_write_buffer_size():
                self.transport.abort()  # close() would wait for the unread bytes to go

        def connection_lost(self, exc) -> None:
            self._disarm_head()
            self._send_timer = _cancelled(self._send_timer)
            super().connection_lost(exc)

    return HeadDeadline


def _more_descriptors() -> None:
    """The soft limit on open files raised to the hard one (at most 65536): 1024 sockets are
    quickly held by clients, each until its deadline."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main_api(argv: list[str]) -> int:
    ap = _Parser(prog="meshdit api", description="An OpenAI-compatible image and video service: "
                 "one diffusers pipeline resident, its transformer on a meshdit mesh.")
    add_engine_options(ap)
    s = ap.add_argument_group("the service")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; another is reachable by others: "
                        "use --api-key)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed)")
    s.add_argument("--api-key", default=os.environ.get("MESHDIT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default $MESHDIT_API_KEY)")
    s.add_argument("--model-name", help="the model id clients name (default: --model's last part)")
    lim = Limits()
    for f in dataclasses.fields(Limits):
        s.add_argument("--" + f.name.replace("_", "-"), type=int, default=getattr(lim, f.name),
                       help=f"default {getattr(lim, f.name)}")
    s.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's (default warning)")
    a = ap.parse_args(argv)
    check_engine_args(ap, a)
    limits = Limits(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Limits)})
    for f in dataclasses.fields(Limits):
        if getattr(limits, f.name) < (0 if f.name == "max_queue" else 1):
            ap.error(f"--{f.name.replace('_', '-')} {getattr(limits, f.name)}: too small")
    if not 0 <= a.port <= 65535:
        ap.error(f"--port {a.port}: 0 to 65535")
    if a.api_key is not None and not a.api_key:
        ap.error("--api-key is empty")
    if a.api_key is not None and not all(0x21 <= ord(c) <= 0x7E for c in a.api_key):
        # an HTTP header carries it: a client cannot send other characters as they are
        ap.error("--api-key: only visible ASCII characters (no spaces, no other letters)")
    # the model id: a folder's name, or the hub id as given
    name = a.model_name or (os.path.basename(os.path.abspath(a.model)) if os.path.isdir(a.model)
                            else a.model)

    import uvicorn

    def log(line):
        print(line, flush=True)

    def make():
        e = engine_from_args(a, log=log)
        e.created = time.time()
        return e
    # the address is taken before the pipeline loads, so a bad host or a busy port is told at
    # once; it listens (takes connections) only once the model is ready
    try:
        host = a.host.strip("[]")
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, a.port))
    except OSError as e:
        print(f"meshdit: error: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    svc = Service(make, limits, name)
    stop = threading.Event()
    prev = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    svc.start()
    while not svc.ready.wait(0.1):
        pass  # a stop signal during the load: the load finishes, then the mesh is closed
    if svc.load_error is not None:
        e = svc.load_error
        print(str(e) if str(e).startswith("meshdit") else f"meshdit: error: {e}", file=sys.stderr)
        sock.close()
        return 1
    if stop.is_set():
        sock.close()
        svc.shutdown()
        return 0
    try:
        sock.listen(128)
    except OSError as e:
        print(f"meshdit: error: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        sock.close()
        svc.shutdown()
        return 1
    port = sock.getsockname()[1]
    if not _loopback(host):
        print(f"meshdit api: listening on {a.host}, which other machines can reach"
              + ("" if a.api_key else " with no --api-key: anyone who reaches it can use it"),
              flush=True)
    for sig, h in prev.items():
        signal.signal(sig, h)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # a stop signal is the way to end the service: exit 0 afterwards, not the signal
            getattr(self, "_captured_signals", []).clear()
            threading.Thread(target=svc.begin_shutdown, daemon=True).start()

    _more_descriptors()
    config = uvicorn.Config(create_app(svc, a.api_key), log_level=a.log_level,
                            access_log=False, timeout_graceful_shutdown=30, lifespan="off",
                            http=_head_deadline_protocol(limits.header_timeout,
                                                         limits.body_timeout))
    server = _Server(config)
    shown = f"[{host}]" if fam == socket.AF_INET6 else host
    print(f"meshdit api: {svc.engine.class_name} '{name}' ({plan_line(svc.engine.transformer.info)})",
          flush=True)
    print(f"listening on http://{shown}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        svc.shutdown()
    return 0
