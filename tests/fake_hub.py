"""A local stand-in for the Hub's HTTP API, for tests that must not touch the network.

It serves one model repo from a folder (repo info, tree, file resolution with
ranges) and accepts uploads (repo creation, preupload, LFS batch and PUT, commit),
recording every request huggingface_hub makes. Like the Hub, it refuses an LFS object whose bytes
do not hash to its oid or have another size than the batch announced, and a commit naming an LFS
object that was never uploaded (HTTP 422, which huggingface_hub raises). It binds 127.0.0.1 only and shuts
itself down after `lifetime_s`, so a stuck test cannot leave it running.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class FakeHub:
    repo_id: str = "org/tiny-moe"
    served: Path | None = None  # folder whose files the repo holds
    lifetime_s: float = 120.0
    requests: list[Request] = field(default_factory=list)
    uploaded: dict[str, bytes] = field(default_factory=dict)  # LFS oid -> bytes, each checked against its oid
    announced: dict[str, int] = field(default_factory=dict)  # LFS oid -> size, from the batch request
    committed: dict[str, bytes] = field(default_factory=dict)  # path -> bytes of the accepted commit

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _record(self) -> bytes:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                hub.requests.append(Request(self.command, self.path, headers, body))
                return body

            def _reply(self, status: int, payload: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _json(self, data, status: int = 200) -> None:
                self._reply(status, json.dumps(data).encode(), {"Content-Type": "application/json"})

            def do_GET(self):
                self._record()
                hub.get(self)

            do_HEAD = do_GET

            def do_POST(self):
                hub.post(self, self._record())

            def do_PUT(self):
                body = self._record()
                oid = self.path.rsplit("/", 1)[-1]
                if hashlib.sha256(body).hexdigest() != oid or hub.announced.get(oid) != len(body):
                    return self._json({"error": f"LFS object {oid}: bytes do not match its oid or size"}, 400)
                hub.uploaded[oid] = body
                self._reply(200)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self._deadline = threading.Timer(self.lifetime_s, self.server.shutdown)
        self._deadline.start()
        return self

    def __exit__(self, *exc) -> None:
        self._deadline.cancel()
        self.server.shutdown()
        self.server.server_close()

    # -- downloads ------------------------------------------------------------------------------
    def _files(self) -> dict[str, Path]:
        return {p.relative_to(self.served).as_posix(): p for p in sorted(self.served.rglob("*")) if p.is_file()}

    def _entry(self, name: str) -> dict:
        file = self._files()[name]
        return {"type": "file", "path": name, "size": file.stat().st_size,
                "oid": hashlib.sha1(file.read_bytes()).hexdigest()}

    def get(self, handler) -> None:
        path = handler.path.split("?")[0]
        api = f"/api/models/{self.repo_id}"
        if path in (api, f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
            return handler._json({"id": self.repo_id, "sha": COMMIT, "private": False,
                                  "siblings": [{"rfilename": f} for f in self._files()]})
        if path.startswith(f"{api}/tree/"):
            return handler._json([self._entry(name) for name in self._files()])
        prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(prefix):
            filename = path[len(prefix):].split("/", 1)[1]
            file = self._files().get(filename)
            if file is None:
                return handler._reply(404, headers={"X-Error-Code": "EntryNotFound"})
            data = file.read_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            if "Range" in handler.headers:
                start, end = handler.headers["Range"].removeprefix("bytes=").split("-")
                data = data[int(start):int(end) + 1]
                return handler._reply(206, data, headers)
            return handler._reply(200, data, headers)
        handler._reply(404, headers={"X-Error-Code": "RepoNotFound"})

    # -- uploads --------------------------------------------------------------------------------
    def post(self, handler, body: bytes) -> None:
        path = handler.path.split("?")[0]
        if path == "/api/repos/create":
            name = json.loads(body)["name"]
            return handler._json({"url": f"{self.endpoint}/{json.loads(body).get('organization', 'user')}/{name}"})
        if path.startswith(f"/api/models/{self.repo_id}/paths-info/"):
            paths = parse_qs(body.decode()).get("paths", [])
            return handler._json([self._entry(name) for name in paths if name in self._files()])
        if path == "/api/validate-yaml":
            return handler._json({"errors": [], "warnings": []})
        if "/preupload/" in path:
            files = json.loads(body)["files"]
            return handler._json({"files": [{"path": f["path"], "shouldIgnore": False,
                                             "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular"}
                                            for f in files]})
        if path.endswith(".git/info/lfs/objects/batch"):
            objects = json.loads(body)["objects"]
            self.announced.update({o["oid"]: o["size"] for o in objects})
            return handler._json({"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"],
                 "actions": {"upload": {"href": f"{self.endpoint}/lfs-upload/{o['oid']}"}}} for o in objects]})
        if "/commit/" in path:
            try:
                self.committed = self._commit_files(body)
            except ValueError as e:
                return handler._json({"error": str(e)}, 422)
            return handler._json({"commitUrl": f"{self.endpoint}/{self.repo_id}/commit/{COMMIT}",
                                  "commitOid": COMMIT})
        handler._reply(404)

    def _commit_files(self, body: bytes) -> dict[str, bytes]:
        """path -> bytes of a commit's files; ValueError for an LFS pointer to an object never uploaded."""
        files = {}
        for op in (json.loads(line) for line in body.decode().splitlines() if line):
            value = op["value"]
            if op["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif op["key"] == "lfsFile":
                data = self.uploaded.get(value["oid"])
                if data is None or len(data) != value["size"]:
                    raise ValueError(f"{value['path']}: LFS object {value['oid']} of {value['size']} bytes "
                                     "was never uploaded")
                files[value["path"]] = data
        return files

    def commit_operations(self) -> list[dict]:
        """The operations of the commit request, one per line of its NDJSON body."""
        commit = next(r for r in self.requests if "/commit/" in r.path)
        return [json.loads(line) for line in commit.body.decode().splitlines() if line]
