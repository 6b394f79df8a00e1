"""`meshdit api`, started as a user starts it (``python -m meshdit api``) on tiny pipelines: the
official `openai` client gets the image that `meshdit generate` writes and diffusers makes;
refused requests are 4xx in OpenAI's error shape and the service goes on; 20 concurrent requests
each get their own seed's image; server-sent progress and previews; cancel of a queued and a
running job; a video job to MP4 (Wan); a rank killed mid-job, after which the job completes with
the same image; SIGTERM ends it with exit 0 and no rank left. The queue itself (positions,
limit) is checked in this process on a stand-in engine whose steps the test releases."""
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import warnings

import httpx
import numpy as np
import openai
import pytest
import torch

import flux_pipeline
from meshdit import api as mapi
from meshdit import generate as mg
from service_util import (Api, env_with_package, levels, meshdit_cmd, pil_pixels, png_pixels,
                          serve_processes)

KEY = "sk-test-meshdit"
TXT = 32
GEN = {"steps": 2, "max_sequence_length": TXT}  # the extensions every image request here sends
warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("api") / "flux_tiny")
    flux_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def service(flux_root):
    api = Api(flux_root, "--tp", "2", "--api-key", KEY, "--max-queue", "32", "--max-n", "2",
              "--max-pixels", str(128 * 128), "--max-steps", "400", "--header-timeout", "4",
              "--body-timeout", "4")
    yield api
    api.stop()


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def diffusers_flux(flux_root):
    return flux_pipeline.load(flux_root)


def diffusers_pixels(pipe, seed, steps=2):
    with torch.inference_mode():
        out = pipe(prompt="a red cube", height=64, width=64, num_inference_steps=steps,
                   guidance_scale=3.5, max_sequence_length=TXT, output_type="pil",
                   generator=torch.Generator("cpu").manual_seed(seed))
    return pil_pixels(out.images[0])


def post(service, path, body=None, key=KEY, **kw):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    return httpx.post(f"{service.url}{path}", content=body, timeout=120,
                      headers={**headers, "content-type": "application/json"}, **kw)


def get(service, path, key=KEY):
    return httpx.get(f"{service.url}{path}", timeout=60,
                     headers={"authorization": f"Bearer {key}"} if key else {})


def sse(response):
    """(event name, data) pairs of a server-sent event stream."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])


def test_openai_client_image_equals_generate_and_diffusers(service, client, flux_root, diffusers_flux,
                                                           tmp_path):
    r = client.images.generate(prompt="a red cube", size="64x64", n=1, response_format="b64_json",
                               extra_body={"seed": 3, **GEN})
    assert len(r.data) == 1 and r.data[0].model_extra["seed"] == 3
    got = png_pixels(r.data[0].b64_json)
    out = tmp_path / "gen.png"
    g = subprocess.run(meshdit_cmd("generate", "--model", flux_root, "--prompt", "a red cube",
                                   "--size", "64x64", "--seed", "3", "--steps", "2", "--tp", "2",
                                   "--max-sequence-length", str(TXT), "--out", str(out)),
                       capture_output=True, text=True, env=env_with_package(), timeout=300)
    assert g.returncode == 0, g.stderr
    assert np.array_equal(got, png_pixels(out.read_bytes()))  # the same mesh, the same pixels
    ref = diffusers_pixels(diffusers_flux, 3)
    assert levels(got, ref) <= 1, levels(got, ref)
    assert levels(diffusers_pixels(diffusers_flux, 4), ref) > 8  # another seed differs
    md = r.model_extra["meshdit"]
    assert md["status"] == "completed" and md["steps"] == 2 and md["seeds"] == [3]
    assert md["pipeline_kwargs"]["guidance_scale"] == 3.5  # the pipeline's default, explicit
    models = client.models.list()
    assert [m.id for m in models.data] == ["flux_tiny"] and models.data[0].model_extra["kind"] == "image"


BAD = [
    ({"prompt": "x", "size": "64x64", "lora": {"style": 1}}, 400, "lora", "no adapter 'style' (loaded: none"),
    ({"prompt": "x", "lora": ["style"]}, 400, "lora", "must be an object"),
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"prompt": "x", "n": 3}, 400, "n", "n 3: must be 1 to 2"),
    ({"prompt": "x", "size": "256x256"}, 400, "size", "over the limit of 16,384"),
    ({"prompt": "x", "size": "72x64"}, 400, "size", "multiple of 16"),
    ({"prompt": "x", "size": "big"}, 400, "size", "not WIDTHxHEIGHT"),
    ({"prompt": "x", "colour": "red"}, 400, "colour", "unknown field 'colour'"),
    ({"prompt": "x", "quality": "hd"}, 400, "quality", "does not implement"),
    ({"prompt": "x", "n": "2"}, 400, "n", "must be an integer"),
    ({"prompt": "x", "n": True}, 400, "n", "must be an integer"),
    ({"prompt": "x", "size": "64x64", "steps": 500}, 400, "steps", "1 to 400"),
    ({"size": "64x64"}, 400, "prompt", "'prompt' is required"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format", "b64_json only"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model", "not served here"),
    ({"prompt": "x", "size": "64x64", "negative_prompt": "y"}, 400, "negative_prompt", "needs true CFG"),
    ({"prompt": "x", "size": "64x64", "seed": -1}, 400, "seed", "seed -1"),
]


def test_bad_requests_are_4xx_and_the_service_goes_on(service):
    for body, status, param, msg in BAD:
        r = post(service, "/v1/images/generations", body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, r.text
        assert msg in err["message"] and "\n" not in err["message"], (body, err)
    assert post(service, "/v1/images/generations", {"prompt": "x"}, key=None).status_code == 401
    assert post(service, "/v1/images/generations", {"prompt": "x"}, key="sk-wrong").status_code == 401
    assert get(service, "/v1/models", key=None).status_code == 401
    assert get(service, "/health", key=None).json()["status"] == "ok"  # no key needed
    r = get(service, "/v1/nothing")
    assert r.status_code == 404 and "no endpoint GET /v1/nothing" in r.json()["error"]["message"]
    # a trailing slash is another path (no 307 to a URL made from the client's Host header)
    r = httpx.post(f"{service.url}/v1/images/generations/", json={"prompt": "x"}, timeout=60,
                   headers={"authorization": f"Bearer {KEY}", "host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers, r.headers
    r = get(service, "/v1/images/generations")  # the statuses' own headers
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    r = get(service, "/v1/models", key=None)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = post(service, "/v1/images/generations", {"prompt": "x", "size": "64x64", "steps": 2,
                                                  "preview_every": 3})
    assert r.status_code == 400 and "over the 2 steps" in r.json()["error"]["message"], r.text
    r = post(service, "/v1/videos", {"prompt": "x"})
    assert r.status_code == 400 and "makes images" in r.json()["error"]["message"]
    assert get(service, "/v1/jobs/img_nope").status_code == 404
    r = post(service, "/v1/images/generations", {"prompt": "a red cube", "size": "64x64", "seed": 3, **GEN})
    assert r.status_code == 200 and len(r.json()["data"]) == 1  # still serving


def test_twenty_concurrent_requests_each_get_their_seed(service, client, diffusers_flux):
    seeds = list(range(100, 120))

    def one(seed):
        r = client.images.generate(prompt="a red cube", size="64x64", response_format="b64_json",
                                   extra_body={"seed": seed, **GEN})
        return seed, r
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, seeds))
    refs = {s: diffusers_pixels(diffusers_flux, s) for s in seeds}
    ids = set()
    for seed, r in results:
        assert r.data[0].model_extra["seed"] == seed and r.model_extra["meshdit"]["seeds"] == [seed]
        ids.add(r.model_extra["meshdit"]["id"])
        px = png_pixels(r.data[0].b64_json)
        assert levels(px, refs[seed]) <= 1, seed  # its own seed's image ...
        assert all(levels(px, refs[o]) > 8 for o in seeds if o != seed)  # ... and no other's
    assert len(ids) == 20


def test_stream_reports_progress_and_previews(service):
    """SSE: queued, started, a progress event per step with s/step, a preview every step (the
    predicted final image: at the last step, the image itself), then the image."""
    body = {"prompt": "a red cube", "size": "64x64", "seed": 3, "stream": True, "preview_every": 1,
            "steps": 3, "max_sequence_length": TXT}
    with httpx.stream("POST", f"{service.url}/v1/images/generations", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse(r))
    names = [n for n, _ in events]
    assert names[:2] == ["image_generation.queued", "image_generation.started"]
    assert names[2:] == ["image_generation.progress", "image_generation.partial_image"] * 3 + \
        ["image_generation.completed"]
    prog = [d for n, d in events if n == "image_generation.progress"]
    assert [p["step"] for p in prog] == [1, 2, 3] and all(p["s_per_step"] > 0 for p in prog)
    partial = [d for n, d in events if n == "image_generation.partial_image"]
    # OpenAI's running count of an image's partial images; meshdit's image_index: which image
    assert [(d["partial_image_index"], d["image_index"]) for d in partial] == [(0, 0), (1, 0), (2, 0)]
    previews = [png_pixels(d["b64_json"]) for d in partial]
    final = png_pixels(events[-1][1]["b64_json"])
    assert np.array_equal(previews[-1], final) and levels(previews[0], final) > 8


def _stream_job(service, body, ready):
    """Starts a streaming image request in a thread; `ready` gets the job id; returns the
    thread and the list its events go to."""
    events = []

    def run():
        with httpx.stream("POST", f"{service.url}/v1/images/generations", json=body, timeout=300,
                          headers={"authorization": f"Bearer {KEY}"}) as r:
            for name, data in sse(r):
                events.append((name, data))
                if name == "image_generation.queued" and not ready.done():
                    ready.set_result(data["id"])
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, events


def test_cancel_a_queued_and_a_running_job(service):
    long = {"prompt": "a red cube", "size": "64x64", "seed": 1, "stream": True, "steps": 400,
            "max_sequence_length": TXT}
    fa, fb = concurrent.futures.Future(), concurrent.futures.Future()
    ta, ea = _stream_job(service, long, fa)
    a = fa.result(60)
    tb, eb = _stream_job(service, {**long, "seed": 2}, fb)
    b = fb.result(60)
    deadline = time.monotonic() + 60
    while get(service, f"/v1/jobs/{a}").json()["step"] < 2:  # a is running, b waits
        assert time.monotonic() < deadline
        time.sleep(0.02)
    jb = get(service, f"/v1/jobs/{b}").json()
    assert jb["status"] == "queued" and jb["queue_position"] == 1
    r = post(service, f"/v1/jobs/{b}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    r = post(service, f"/v1/jobs/{a}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    ta.join(60)
    tb.join(60)
    ja = get(service, f"/v1/jobs/{a}").json()
    assert ja["status"] == "cancelled" and 2 <= ja["step"] < 400  # stopped between two steps
    assert ea[-1][0] == "image_generation.cancelled" and "cancelled" in ea[-1][1]["error"]["message"]
    assert eb[-1][0] == "image_generation.cancelled" and get(service, f"/v1/jobs/{b}").json()["step"] == 0
    r = post(service, "/v1/images/generations", {"prompt": "a red cube", "size": "64x64", "seed": 3, **GEN})
    assert r.status_code == 200  # the service goes on


HOSTILE = [  # what a probe sent: each one a 400 naming its field, never a job
    ({"true_cfg": float("nan")}, "true_cfg", "finite number"),
    ({"true_cfg": float("inf")}, "true_cfg", "finite number"),
    ({"true_cfg": 1e308}, "true_cfg", "at most 1e+06"),
    ({"guidance": float("nan")}, "guidance", "finite number"),
    ({"guidance": 1e38}, "guidance", "at most 1e+06"),
    ({"guidance": 10 ** 400}, "guidance", "finite number"),
    ({"max_sequence_length": 1000}, "max_sequence_length", "FluxPipeline takes 1 to 512"),
    ({"prompt": "a \ud800 cube"}, "prompt", "valid Unicode"),
    ({"negative_prompt": "\udfff", "true_cfg": 2.0}, "negative_prompt", "valid Unicode"),
    ({"size": "1_6x64"}, "size", "not WIDTHxHEIGHT"),
    ({"size": "+64x64"}, "size", "not WIDTHxHEIGHT"),
    ({"size": " 64x64"}, "size", "not WIDTHxHEIGHT"),
    ({"size": "\uff16\uff14x64"}, "size", "not WIDTHxHEIGHT"),  # full-width digits
]


def test_hostile_values_are_400_naming_the_field(service):
    for extra, param, msg in HOSTILE:
        body = {"prompt": "a red cube", "size": "64x64", "seed": 1, **GEN, **extra}
        r = post(service, "/v1/images/generations", body)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and msg in err["message"], (extra, err)
    r = get(service, "/v1/jobs")  # no job was stored: the list is still JSON
    assert r.status_code == 200 and all(j["status"] != "failed" for j in r.json()["data"])
    r = httpx.get(f"{service.url}/v1/models", headers={"authorization": f"bearer {KEY}"})
    assert r.status_code == 200, r.text  # the scheme is case-insensitive
    assert httpx.get(f"{service.url}/v1/models",
                     headers={"authorization": f"Basic {KEY}"}).status_code == 401


def _raw(service, data: bytes):
    import socket
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(data)
    return s


def test_body_limit_while_chunked_and_a_client_that_leaves(service):
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\n").encode()
    # a chunked body past 1 MiB, never finished: answered 413 as it passes the limit
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    s = _raw(service, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 17)
    try:
        assert s.recv(200).startswith(b"HTTP/1.1 413"), "no 413 before the body's end"
    finally:
        s.close()
    # the same for the forms /v1/videos takes (what the openai client sends): a chunked form was
    # read whole, with no limit, before the field count was checked
    for ctype in (b"multipart/form-data; boundary=xyz", b"application/x-www-form-urlencoded"):
        form_head = (f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     ).encode() + b"Content-Type: " + ctype + b"\r\n"
        fill = b"a" * 65536
        s = _raw(service, form_head + b"Transfer-Encoding: chunked\r\n\r\n" +
                 (b"%x\r\n%s\r\n" % (len(fill), fill)) * 17)
        try:
            assert s.recv(200).startswith(b"HTTP/1.1 413"), (ctype, "no 413 before the end")
        finally:
            s.close()
    # a client that leaves mid-body: no traceback in the log
    before = service.log().count("Traceback")
    s = _raw(service, head + b"Content-Length: 1000\r\n\r\n{\"prompt\"")
    time.sleep(0.3)
    s.close()
    time.sleep(0.5)
    assert service.log().count("Traceback") == before, service.log()[-3000:]
    # a client that leaves while its (non-streaming) job runs: the job is cancelled
    body = json.dumps({"prompt": "a red cube", "size": "64x64", "seed": 5, "steps": 400,
                       "max_sequence_length": TXT}).encode()
    s = _raw(service, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 60
    job = None
    while job is None or job["step"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
        job = next((j for j in get(service, "/v1/jobs").json()["data"]
                    if j["status"] == "in_progress" and j["seeds"] == [5]), job)
    s.close()
    while get(service, f"/v1/jobs/{job['id']}").json()["status"] == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    j = get(service, f"/v1/jobs/{job['id']}").json()
    assert j["status"] == "cancelled" and j["step"] < 400, j


# ---- the queue, in this process, on a stand-in engine whose steps the test releases -----------
class GatedEngine:
    """Just what the service reads from an Engine; each step waits for `gate`."""

    kind, class_name = "video", "GatedPipeline"
    defaults = {"steps": 2, "width": 16, "height": 16, "multiple": 16, "frames": 1,
                "frame_multiple": 4, "max_sequence_length": 8}

    def __init__(self):
        self.gate = threading.Semaphore(0)
        self.created = time.time()
        self.transformer = type("T", (), {"info": {"family": "stub", "tp": "1"}, "_client": 1,
                                          "resumes": []})()
        self.transformers = [self.transformer]

    def check(self, r, **limits):
        return dataclasses.replace(r, steps=r.steps or 2, width=r.width or 16, height=r.height or 16,
                                   frames=r.frames or 1, seed=0 if r.seed is None else r.seed,
                                   max_sequence_length=8)

    def run(self, r, on_event, cancel, checked):
        for i in range(r.steps):
            while not self.gate.acquire(timeout=0.05):
                if cancel.is_set():
                    raise mg.Cancelled()
            on_event("step", step=i + 1, steps=r.steps, seconds=0.0, s_per_step=0.001)
            if r.preview_every and (i + 1) % r.preview_every == 0:
                from PIL import Image
                on_event("preview", step=i + 1, steps=r.steps, images=[Image.new("RGB", (16, 16))])
            if cancel.is_set():
                raise mg.Cancelled()
        return mg.Result(kind="video", images=[], frames=np.zeros((1, 16, 16, 3), np.float32), fps=r.fps,
                         seeds=[r.seed], width=16, height=16, steps=r.steps, pipeline_kwargs={},
                         seconds=0.0, step_seconds=[], resumes=[])

    def close(self):
        pass


@contextlib.contextmanager
def gated_app(monkeypatch, **limits):
    """The service in this process on a GatedEngine, and a test client of its app."""
    from starlette.testclient import TestClient
    monkeypatch.setattr(mapi, "video_bytes", lambda frames, fps: b"mp4")
    eng = GatedEngine()
    svc = mapi.Service(lambda: eng, mapi.Limits(**limits), "stub")
    svc.start()
    assert svc.ready.wait(10)
    try:
        with TestClient(mapi.create_app(svc)) as c:
            yield eng, svc, c
    finally:
        svc.shutdown(10)


def test_queue_positions_limit_and_cancel(monkeypatch):
    with gated_app(monkeypatch, max_queue=2) as (eng, svc, c):
        ids = []
        for seed in range(3):  # one runs, two wait
            r = c.post("/v1/videos", json={"prompt": "x", "seed": seed})
            assert r.status_code == 200 and r.json()["object"] == "video"
            ids.append(r.json()["id"])
            deadline = time.monotonic() + 10
            while c.get(f"/v1/videos/{ids[0]}").json()["status"] != "in_progress":
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert [c.get(f"/v1/videos/{i}").json()["queue_position"] for i in ids] == [0, 1, 2]
        r = c.post("/v1/videos", json={"prompt": "x"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert c.post(f"/v1/videos/{ids[1]}/cancel").json()["status"] == "cancelled"
        assert c.get(f"/v1/videos/{ids[2]}").json()["queue_position"] == 1  # moved up
        r = c.get(f"/v1/videos/{ids[1]}/content")
        assert r.status_code == 409 and "cancelled" in r.json()["error"]["message"]
        for _ in range(4):
            eng.gate.release()
        deadline = time.monotonic() + 10
        while c.get(f"/v1/videos/{ids[2]}").json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.get(f"/v1/videos/{ids[2]}/content").content == b"mp4"
        with c.stream("GET", f"/v1/jobs/{ids[2]}/events") as r:
            ev = [(n, d) for n, d in sse(r)]
        assert [d["queue_position"] for n, d in ev if n == "job.queued"] == [2, 1]
        assert [n for n, _ in ev][-3:] == ["job.progress", "job.progress", "job.completed"]
        page = c.get("/v1/videos?limit=2").json()  # OpenAI's list: newest first, paged
        assert [v["id"] for v in page["data"]] == [ids[2], ids[1]] and page["has_more"], page
        rest = c.get(f"/v1/videos?limit=2&after={page['last_id']}").json()
        assert [v["id"] for v in rest["data"]] == [ids[0]] and not rest["has_more"], rest
        assert [v["id"] for v in c.get("/v1/videos?order=asc").json()["data"]] == ids
        assert c.get("/v1/videos?after=video_nope").status_code == 404
        oc = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=c)
        assert [v.id for v in oc.videos.list(limit=1)] == ids[::-1]  # the client pages on
        assert c.delete(f"/v1/videos/{ids[2]}").json()["deleted"] is True
        assert c.get(f"/v1/videos/{ids[2]}").status_code == 404
        rest = c.get(f"/v1/videos?after={ids[2]}").json()  # a cursor deleted meanwhile
        assert [v["id"] for v in rest["data"]] == [ids[1], ids[0]], rest


def test_slow_clients_are_closed_and_a_quick_one_is_not(service):
    """A client that sends half its headers is closed after --header-timeout (4 s here), one that
    sends half a body, or a chunked body that never ends, gets a 408 after --body-timeout (4 s);
    before, uvicorn waited for each for good and 1,100 of them took every file descriptor. A
    client that waits 4.5 s on a kept-alive connection between two requests is not cut."""
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\n").encode()
    t0 = time.monotonic()
    half_head = _raw(service, head[:40])
    half_body = _raw(service, head + b"Content-Length: 1000\r\n\r\n{\"prompt\"")
    endless = _raw(service, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
    try:
        for s in (half_head, half_body, endless):
            s.settimeout(15)
        assert half_head.recv(100) == b"" and 3.5 < time.monotonic() - t0 < 12
        for s in (half_body, endless):
            got = b""
            while b"body_timeout" not in got and (part := s.recv(2000)):
                got += part
            assert got.startswith(b"HTTP/1.1 408") and b"body_timeout" in got, got
        assert time.monotonic() - t0 < 12
    finally:
        for s in (half_head, half_body, endless):
            s.close()
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as c:
        assert c.get(f"{service.url}/v1/models").status_code == 200
        time.sleep(4.5)  # past the header timeout, inside the keep-alive one (5 s)
        assert c.get(f"{service.url}/v1/models").status_code == 200
    # a slow link above the minimum rate (16 KiB/s): 250 KB in 5 s, past the body timeout's 4 s,
    # is read whole (and refused for its field, not timed out)
    body = json.dumps({"colour": "x" * 250000}).encode()
    s = _raw(service, head + b"Content-Length: %d\r\n\r\n" % len(body))
    try:
        for k in range(0, len(body), 10000):
            s.sendall(body[k:k + 10000])
            time.sleep(0.2)
        got = b""
        while b"unknown_parameter" not in got and (part := s.recv(4000)):
            got += part
        assert got.startswith(b"HTTP/1.1 400") and b"unknown_parameter" in got, got[:300]
    finally:
        s.close()
    # a client that sends requests and never reads the answers: dropped once its answers have
    # waited unread for the body timeout (4 s); before, it held its connection for good
    import socket
    import struct
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answers back up at once
    s.connect((host, int(port)))
    s.setblocking(False)
    req = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
           .encode() * 1000)  # each answer ~1 KB: the buffers fill in a few seconds
    t0, state = time.monotonic(), 1
    while time.monotonic() - t0 < 40 and state == 1:  # 1: TCP_ESTABLISHED
        try:
            s.send(req)
        except (BlockingIOError, ConnectionError):
            pass
        time.sleep(0.1)
        state = struct.unpack("B", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[:1])[0]
    print(f"a client that never reads: dropped after {time.monotonic() - t0:.1f} s")
    s.close()
    assert state != 1 and 3.5 < time.monotonic() - t0 < 30, (state, time.monotonic() - t0)
    assert get(service, "/health").json()["status"] == "ok"


def test_finished_jobs_keep_their_previews_events_not_images(monkeypatch):
    """A preview's image is in the events while its job runs; once the job has finished the
    event stays with b64_json null. Before, every kept job (64) held every preview (a 1024² job
    with 8 previews, 27 MB)."""
    with gated_app(monkeypatch) as (eng, svc, c):
        r = c.post("/v1/videos", json={"prompt": "x", "steps": 2, "preview_every": 1})
        job = svc.get(r.json()["id"])
        eng.gate.release()
        deadline = time.monotonic() + 10
        while not any(e["type"] == "preview" for e in job.events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert isinstance(next(e for e in job.events if e["type"] == "preview")["b64_json"], str)
        eng.gate.release()
        while not job.done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        previews = [e for e in job.events if e["type"] == "preview"]
        assert len(previews) == 2 and all(e["b64_json"] is None for e in previews), previews
        with c.stream("GET", f"/v1/jobs/{job.id}/events") as r:
            names = [n for n, _ in sse(r)]
        assert names.count("job.preview") == 2 and names[-1] == "job.completed", names


def test_hostile_bodies_queries_and_forms(monkeypatch):
    """What a probe sent that was answered 500, read loosely or skipped: each now a 400 naming
    it in one short line."""
    with gated_app(monkeypatch) as (eng, svc, c):
        def refused(r, code, text):
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == code and text in err["message"], err
            assert "\n" not in err["message"] and len(err["message"]) < 400, err
        hdr = {"content-type": "application/json"}
        refused(c.post("/v1/videos", content=b"[" * 100000 + b"]" * 100000, headers=hdr),
                "invalid_json", "nested too deeply")
        refused(c.post("/v1/videos", json={"prompt": "x", "size": "1" * 5000 + "x16"}),
                "invalid_size", "more than 9 digits")
        refused(c.post("/v1/videos", content=b'{"prompt": "x", "steps": 2, "steps": 3}',
                       headers=hdr), "invalid_value", "'steps' given twice")
        refused(c.post("/v1/videos?n=2", json={"prompt": "x"}), "unknown_parameter",
                "unknown query parameter 'n' for POST /v1/videos")
        refused(c.get("/v1/videos?limit=abc"), "invalid_value", "limit 'abc'")
        refused(c.get("/v1/videos?limit=%20%31"), "invalid_value", "an integer from 1 to 100")
        refused(c.get("/v1/videos?order=up"), "invalid_value", "asc or desc")
        refused(c.get("/v1/videos?before=x"), "unknown_parameter", "'before'")
        assert c.get("/health?nocache=1").status_code == 200  # a checker's cache-buster
        assert c.head("/health").status_code == 200
        refused(c.get("/v1/videos/v/content?variant=video&variant=x"), "invalid_value",
                "given twice")
        for seconds in (True, "4_0", " 4 ", "\u0664"):
            refused(c.post("/v1/videos", json={"prompt": "x", "seconds": seconds}),
                    "invalid_type", "'seconds' must be a number")
        for v in (" 16", "1_6", "+2", "\u0663"):
            refused(c.post("/v1/videos", data={"prompt": "x", "steps": v}), "invalid_type",
                    "'steps' must be an integer")
        for raw, ctype, text in (  # Latin-1, not UTF-8
                (b"prompt=caf%E9", "application/x-www-form-urlencoded", "not valid UTF-8"),
                (b"prompt=\xff\xfe", "application/x-www-form-urlencoded", "must be ASCII"),
                (b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\ncaf\xe9\r\n'
                 b"--b--\r\n", "multipart/form-data; boundary=b", "not valid UTF-8")):
            refused(c.post("/v1/videos", content=raw, headers={"content-type": ctype}),
                    "invalid_value", text)
        assert c.post("/v1/videos", data={"prompt": "a \ufffd b", "steps": "1"}).status_code == 200
        refused(c.post("/v1/videos", json={"prompt": "x" * 16385}), "invalid_value",
                "'prompt' has 16,385 characters, over the limit of 16,384")
        refused(c.post("/v1/videos", data={"prompt": "x", "negative_prompt": "y" * 20000}),
                "invalid_value", "'negative_prompt' has 20,000 characters")
        assert c.post("/v1/videos", json={"prompt": "x" * 16384}).status_code == 200
        refused(c.post("/v1/videos", data={"prompt": "x"}, files={"input": ("a", b"x")}),
                "unsupported_parameter", "file uploads are not supported")
        refused(c.post("/v1/videos", data={f"f{i}": "1" for i in range(70)}),
                "invalid_request", "")
        refused(c.post("/v1/videos", json={"prompt": "x", "k" * 500000 + "\nz": 1}),
                "unknown_parameter", "unknown field 'kkk")
        refused(c.post("/v1/videos", json={"prompt": "x", "size": "16x16\nInjected: 1"}),
                "invalid_size", "16x16\\nInjected")


# ---- video: a tiny Wan pipeline ------------------------------------------------------------------
def test_video_job_to_mp4(tmp_path_factory):
    import imageio.v3 as iio

    import wan_pipeline
    root = str(tmp_path_factory.mktemp("api_wan") / "wan_tiny")
    wan_pipeline.build(root, seed=0)
    ref = wan_pipeline.generate(wan_pipeline.load(root), seed=9, steps=2)  # [5, 32, 48, 3] in [0, 1]
    other = wan_pipeline.generate(wan_pipeline.load(root), seed=10, steps=2)
    api = Api(root, "--ulysses", "2")
    try:
        c = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)
        v = c.videos.create(prompt=wan_pipeline.PROMPT, size="48x32", extra_body={
            "frames": 5, "steps": 2, "seed": 9, "guidance": 5.0,
            "negative_prompt": wan_pipeline.NEGATIVE_PROMPT, "max_sequence_length": wan_pipeline.TXT_LEN})
        assert v.status == "queued" and v.object == "video"
        deadline = time.monotonic() + 120
        while v.status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
            v = c.videos.retrieve(v.id)
        assert v.status == "completed" and v.progress == 100 and v.size == "48x32"
        # the video's length (5 frames at 16 fps), not the job's run time
        assert v.seconds == "0.3125" and v.model_extra["generation_seconds"] > 0, v
        data = c.videos.download_content(v.id).read()
        assert data[4:8] == b"ftyp"  # an MP4
        frames = iio.imread(data, extension=".mp4").astype(np.float32) / 255
        assert frames.shape == ref.shape == (5, 32, 48, 3)
        # H.264 is lossy (on random-weight frames, ~0.04 of the range): compare with diffusers'
        # frames through the same encoder (export_to_video) and decoder
        want, ctrl = (iio.imread(mg.video_bytes(x, 16), extension=".mp4").astype(np.float32) / 255
                      for x in (ref, other))
        err, control = float(np.mean(np.abs(frames - want))), float(np.mean(np.abs(frames - ctrl)))
        assert err < 2e-3 and control > 10 * err + 0.01, (err, control)
        r = httpx.post(f"{api.url}/v1/videos", json={"prompt": "x", "frames": 4}, timeout=60)
        assert r.status_code == 400 and "4k + 1 frames" in r.json()["error"]["message"]
        r = httpx.post(f"{api.url}/v1/images/generations", json={"prompt": "x"}, timeout=60)
        assert r.status_code == 400 and "makes videos" in r.json()["error"]["message"]
    finally:
        assert api.stop() == 0


# ---- a rank lost mid-job; SIGTERM ----------------------------------------------------------------
def test_a_killed_rank_and_then_sigterm(flux_root, service, client, tmp_path):
    """The service's first mesh loses rank 1 in its first forward (MESHDIT_TEST_FAIL, which a
    relaunch does not inherit): the job completes with the image an undisturbed service makes and
    says what happened; then SIGTERM: exit 0, no rank left."""
    want = png_pixels(client.images.generate(prompt="a red cube", size="64x64",
                                             extra_body={"seed": 3, **GEN}).data[0].b64_json)
    root = str(tmp_path / "flux_copy")  # its own path: its ranks are told apart by it
    shutil.copytree(flux_root, root)
    api = Api(root, "--tp", "2", env={"MESHDIT_TEST_FAIL": "step:1:kill"})
    try:
        body = {"prompt": "a red cube", "size": "64x64", "seed": 3, **GEN}
        r = httpx.post(f"{api.url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert np.array_equal(png_pixels(r.json()["data"][0]["b64_json"]), want)
        [rec] = r.json()["meshdit"]["resumes"]
        assert rec["step"] == 1 and "killed" in rec["error"] and rec["seconds"] > 0
        assert httpx.get(f"{api.url}/health").json()["resumes"] == 1
        ranks = serve_processes(root)
        assert len(ranks) >= 3  # the relaunched mesh: launcher and two ranks
    finally:
        rc = api.stop(signal.SIGTERM)
    assert rc == 0, api.log()
    assert not [p for p in ranks if os.path.exists(f"/proc/{p}")], "a rank outlived the service"


def test_image_edits_with_a_mask_equal_diffusers_inpaint(flux_root, service, tmp_path):
    """POST /v1/images/edits (the openai client's images.edit): the image and OpenAI's mask
    (transparent: the area to edit) as files to a FluxInpaintPipeline service give diffusers'
    own inpainting of that image and mask (white: repaint). Refusals name the file or field; a
    service whose pipeline takes no image says so."""
    import io

    import diffusers
    from PIL import Image
    root = tmp_path / "inpaint"
    shutil.copytree(flux_root, root)
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxInpaintPipeline"}))
    img = Image.fromarray((np.random.RandomState(0).rand(48, 80, 3) * 255).astype(np.uint8))
    rgba = Image.new("RGBA", (80, 48), (0, 0, 0, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 40, 48))  # the left half transparent: edit it
    files = {}
    for name, pic in (("image", img), ("mask", rgba)):
        b = io.BytesIO()
        pic.save(b, "PNG")
        files[name] = (f"{name}.png", b.getvalue(), "image/png")
    api = Api(str(root))
    try:
        c = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.images.edit(image=files["image"], mask=files["mask"], prompt="a red cube",
                          extra_body={"steps": 2, "seed": 3, "strength": "0.8",
                                      "max_sequence_length": str(TXT)})
        got = png_pixels(r.data[0].b64_json)
        with httpx.stream("POST", f"{api.url}/v1/images/edits", files=files, timeout=120,
                          data={"prompt": "a red cube", "steps": "2", "seed": "3", "stream": "true",
                                "strength": "0.8", "max_sequence_length": str(TXT)}) as s:
            events = [n for n, _ in sse(s)]
        assert events[-1] == "image_edit.completed" and "image_edit.started" in events, events
        kw = r.model_extra["meshdit"]["pipeline_kwargs"]
        assert kw["image"] == "image 80x48 RGB" and kw["mask_image"] == "image 80x48 L", kw
        assert r.size == "80x48" and kw["strength"] == 0.8
        for body, kw2, code, msg in [
                ({"prompt": "x"}, dict(json={"prompt": "x"}), 400, "multipart/form-data"),
                (None, dict(files={"image": ("a.png", b"not a png", "image/png")},
                            data={"prompt": "x"}), 400, "'image' 'a.png' (9 bytes): not an image"),
                (None, dict(files={"mask": files["mask"]}, data={"prompt": "x"}), 400,
                 "'image' is required"),
                (None, dict(files={"image": files["image"]}, data={"prompt": "x"}), 400,
                 "FluxInpaintPipeline needs a mask"),
                (None, dict(files=files, data={"prompt": "x", "strength": "2"}), 400,
                 "strength 2.0: must be in (0, 1]"),
                (None, dict(content=b"--b\r\nContent-Disposition: form-data; name=\"prompt\""
                                    b"\r\n\r\nx\r\n--b\r\nContent-Disposition: form-data; "
                                    b"name=\"strength\"\r\n\r\n1.0",  # no closing boundary
                            headers={"content-type": "multipart/form-data; boundary=b"}), 400,
                 "the multipart body is incomplete")]:
            e = httpx.post(f"{api.url}/v1/images/edits", timeout=60, **kw2)
            assert e.status_code == code and msg in e.json()["error"]["message"], e.text
    finally:
        assert api.stop() == 0, api.log()
    ref = diffusers.FluxInpaintPipeline.from_pretrained(str(root), torch_dtype=torch.float32)
    def inpainted(left_white):
        m = Image.new("L", (80, 48), 0 if left_white else 255)
        m.paste(255 if left_white else 0, (0, 0, 40, 48))
        with torch.inference_mode():
            return pil_pixels(ref(prompt="a red cube", image=img, mask_image=m, strength=0.8,
                                  height=48, width=80, num_inference_steps=2, guidance_scale=7.0,
                                  max_sequence_length=TXT, output_type="pil",
                                  generator=torch.Generator("cpu").manual_seed(3)).images[0])
    want = inpainted(True)  # OpenAI's transparent half is diffusers' white half
    assert levels(got, want) <= 1, levels(got, want)
    assert levels(got, inpainted(False)) > 8  # the other half: another picture
    r = httpx.post(f"{service.url}/v1/images/edits", files={"image": files["image"]},
                   data={"prompt": "x", "size": "64x64"}, headers={"authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 400 and "FluxPipeline takes no input image" in r.text, r.text


def test_image_edits_qwen_edit_plus_equal_diffusers(tmp_path):
    """POST /v1/images/edits with two image files (image[]) to a QwenImageEditPlusPipeline
    service on ulysses2 (Qwen-Image-Edit-2511's zero_cond_t transformer) gives diffusers' own
    pipeline's edit of those images; a request without an image and an image so elongated that
    the pipeline's resize leaves it a side of 0 are 400s naming 'image' (the latter was a 500)."""
    import io

    import qwenimage_edit_pipeline as qe
    import service_util
    from PIL import Image
    root = str(tmp_path / "qwen_edit")
    qe.build(root, seed=0)
    imgs = qe.reference_images()
    files = []
    for k, pic in enumerate(imgs):
        b = io.BytesIO()
        pic.save(b, "PNG")
        files.append(("image[]", (f"ref{k}.png", b.getvalue(), "image/png")))
    # the api process imports the tiny pipeline's processor module (model_index.json names it)
    # and sizes the condition images as the test pipeline does, before it loads the pipeline
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import qwenimage_edit_pipeline as qe\n"
        "from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as m\n"
        "m.CONDITION_IMAGE_SIZE, m.VAE_IMAGE_SIZE = qe.CONDITION_AREA, qe.VAE_AREA\n")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([str(site), here, service_util.PYTHON_DIR])
    api = Api(root, "--ulysses", "2", env={"PYTHONPATH": path})
    form = {"prompt": qe.PROMPT, "negative_prompt": qe.NEGATIVE_PROMPT, "size": "64x64",
            "guidance": str(qe.TRUE_CFG_SCALE), "steps": "2", "seed": "5"}
    try:
        r = httpx.post(f"{api.url}/v1/images/edits", files=files, data=form, timeout=300)
        assert r.status_code == 200, r.text
        got = png_pixels(r.json()["data"][0]["b64_json"])
        kw = r.json()["meshdit"]["pipeline_kwargs"]
        assert kw["image"] == ["image 96x64 RGB", "image 64x96 RGB"], kw
        b = io.BytesIO()
        Image.new("RGB", (800, 8), (0, 0, 255)).save(b, "PNG")
        e = httpx.post(f"{api.url}/v1/images/edits", data=form, timeout=60,
                       files=[("mask", ("m.png", b.getvalue(), "image/png"))])  # no image
        assert e.status_code == 400 and "'image' is required" in e.text, e.text
        e = httpx.post(f"{api.url}/v1/images/edits", data=form, timeout=60,
                       files=[("image[]", ("thin.png", b.getvalue(), "image/png"))])
        assert e.status_code == 400 and "too elongated" in e.text, e.text
        assert e.json()["error"]["param"] == "image", e.text
    finally:
        assert api.stop() == 0, api.log()
    with qe.condition_areas():
        ref = qe.load(root)
        with torch.inference_mode():
            want = pil_pixels(ref(image=imgs, prompt=qe.PROMPT, negative_prompt=qe.NEGATIVE_PROMPT,
                                  true_cfg_scale=qe.TRUE_CFG_SCALE, height=64, width=64,
                                  num_inference_steps=2, max_sequence_length=512, output_type="pil",
                                  generator=torch.Generator("cpu").manual_seed(5)).images[0])
    assert levels(got, want) <= 1, levels(got, want)

def test_over_memory_is_400_and_a_lost_mesh_is_503_without_resume(flux_root, tmp_path):
    """A request the mesh cannot hold (--max-memory) is the request's failure: 400, which the
    openai client does not retry (it retried the 500 three times). With --no-resume a lost rank
    fails its job, and from then on /health and every new request say 503 (/health said ok)."""
    root = str(tmp_path / "flux_lost")
    shutil.copytree(flux_root, root)
    api = Api(root, "--tp", "2", "--no-resume", "--max-memory", "12M",
              env={"MESHDIT_TEST_FAIL": "step:1:kill"})
    try:
        c = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=2, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            c.images.generate(prompt="x", size="512x512", extra_body={"steps": 1})
        assert e.value.body["code"] == "over_memory_limit" and "--max-memory" in e.value.body["message"]
        jobs = httpx.get(f"{api.url}/v1/jobs", timeout=60).json()["data"]
        assert len(jobs) == 1, jobs  # not retried
        assert httpx.get(f"{api.url}/health", timeout=60).status_code == 200
        r = httpx.post(f"{api.url}/v1/images/generations", json={"prompt": "x", "size": "64x64", **GEN},
                       timeout=120)
        assert r.status_code == 500 and "killed" in r.json()["error"]["message"], r.text
        h = httpx.get(f"{api.url}/health", timeout=60)
        assert h.status_code == 503 and "--no-resume" in h.json()["error"], h.text
        r = httpx.post(f"{api.url}/v1/images/generations", json={"prompt": "x", "size": "64x64", **GEN},
                       timeout=120)
        assert r.status_code == 503 and r.json()["error"]["code"] == "mesh_lost", r.text
    finally:
        assert api.stop() == 0, api.log()


def test_sigterm_while_busy_exits_0_and_takes_every_rank(service):
    """SIGTERM with a job running and one queued: both are cancelled, the mesh closes, exit 0."""
    long = {"prompt": "a red cube", "size": "64x64", "seed": 1, "stream": True, "steps": 400,
            "max_sequence_length": TXT}
    f1, f2 = concurrent.futures.Future(), concurrent.futures.Future()
    t1, e1 = _stream_job(service, long, f1)
    f1.result(60)
    t2, e2 = _stream_job(service, long, f2)
    f2.result(60)
    ranks = serve_processes(f"{service.model}/transformer")  # launcher and ranks
    assert len(ranks) >= 3
    t0 = time.monotonic()
    assert service.stop(signal.SIGTERM) == 0, service.log()
    assert time.monotonic() - t0 < 30
    t1.join(30)
    t2.join(30)
    assert e1[-1][0] == e2[-1][0] == "image_generation.cancelled"
    assert not [p for p in ranks if os.path.exists(f"/proc/{p}")]
