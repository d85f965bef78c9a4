"""Headless Chromium (Debian's `chromium`, installed by scripts/test-services.sh), driven over
the DevTools protocol: load a page, read the DOM, collect console errors, take a screenshot."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

BINARIES = ("chromium", "chromium-browser", "google-chrome")


class CDPError(AssertionError):
    """The browser answered a command with an error."""


def chromium_path() -> str:
    """The browser binary. Raises AssertionError naming the fix when there is none."""
    path = next((p for b in BINARIES if (p := shutil.which(b))), None)
    assert path, "no chromium: run `make test-services` (it installs Debian's chromium package)"
    return path


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="hp-chromium-")
        self.proc = subprocess.Popen(
            [chromium_path(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "--window-size=1400,1300", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = self._devtools_port()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # never let its pipe fill
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self._conn = connect(pages[0]["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=20)
        self.ws = self._conn.__enter__()
        self._id = 0
        self.events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def _devtools_port(self) -> int:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            line = self.proc.stderr.readline()
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                return int(m.group(1))
            assert line or self.proc.poll() is None, "chromium exited before it listened"
        raise AssertionError("chromium did not open its DevTools port in 60 s")

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise CDPError(msg["error"])
                return msg.get("result", {})
            self.events.append(msg)

    def evaluate(self, expr: str) -> Any:
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def wait_for(self, expr: str, timeout: float = 30.0) -> Any:
        """The value of expr once it is truthy; while a navigation is under way (no body
        yet, say) it may throw: that counts as not yet."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True})
            except CDPError:  # the page navigated under the command: not yet
                r = {"exceptionDetails": True}
            value = None if "exceptionDetails" in r else r["result"].get("value")
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"{expr} stayed false for {timeout} s")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        self.send("Runtime.evaluate", {"expression": "1"})  # collect pending events
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e.get("method") == "Runtime.exceptionThrown" and p["exceptionDetails"].get("url"):  # the page's
                out.append(p["exceptionDetails"].get("text", "exception"))
            elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p["entry"]["text"])
        return out

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png",
                                                                      "captureBeyondViewport": True})["data"])
        path.write_bytes(data)
        return data

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.__exit__(None, None, None)
        finally:
            self.proc.kill()
            self.proc.wait(timeout=30)
            shutil.rmtree(self.profile, ignore_errors=True)
