"""Drive Debian's headless Chromium from tests through the DevTools protocol over a pipe.

Why a pipe: ``--remote-debugging-pipe`` makes Chromium speak CDP on file descriptors 3 (commands
in) and 4 (replies out), NUL-terminated JSON. That needs only the standard library: no websocket
client package, no TCP port to pick or to leak, nothing that could reach a network. This gives
the tests what --dump-dom/--screenshot cannot: evaluate JS after the page ran, real mouse clicks
and input events, the console errors, the network requests, and a screenshot after interaction.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-pipe",
)


class BrowserError(RuntimeError):
    pass


def chromium_path() -> str | None:
    path = os.environ.get("PLASMIENT_CHROMIUM", CHROMIUM)
    return path if os.access(path, os.X_OK) else None


class Browser:
    """One headless Chromium process with one page. Use as a context manager."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 30.0, executable: str | None = None):
        exe = executable or chromium_path()
        if exe is None:
            raise BrowserError(f"{CHROMIUM} not found (run scripts/install-test-deps.sh)")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="plasmient-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # Chromium wants the pipe on fds 3 and 4 exactly; bash dups them there, which is safe
        # whatever numbers os.pipe() returned (moved above 9 first so they cannot collide).
        hi_r, hi_w = _fd_above(to_chrome_r, 10), _fd_above(from_chrome_w, 11)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        args = " ".join(_q(a) for a in (exe, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"))
        self._proc = subprocess.Popen(
            ["/bin/bash", "-c", f"exec {args} 3<&{hi_r} 4>&{hi_w} {hi_r}<&- {hi_w}>&-"],
            pass_fds=(hi_r, hi_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(hi_r)
        os.close(hi_w)
        self._next_id = 0
        self._lock = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._closed = False
        self._stderr_tail: list[bytes] = []
        threading.Thread(target=self._read_loop, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.session: str | None = None
        self._open_page(width, height)

    # ---- protocol -----------------------------------------------------------------------------

    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._closed = True
                    self._lock.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._lock:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._lock.notify_all()

    def _drain_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr_tail = (self._stderr_tail + [line])[-30:]

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True) -> dict[str, Any]:
        with self._lock:
            self._next_id += 1
            mid = self._next_id
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        data = json.dumps(msg).encode() + b"\0"
        try:
            os.write(self._to_chrome, data)
        except OSError as exc:
            raise BrowserError(f"chromium exited: {self.stderr_tail()}") from exc
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise BrowserError(f"no reply to {method} ({'chromium exited' if self._closed else 'timeout'}): {self.stderr_tail()}")
                self._lock.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, since: int = 0, timeout: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._lock:
            while True:
                for ev in self.events[since:]:
                    if ev.get("method") == method:
                        return ev
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise BrowserError(f"no {method} event: {self.stderr_tail()}")
                self._lock.wait(left)

    def stderr_tail(self) -> str:
        return b"".join(self._stderr_tail).decode(errors="replace")[-2000:]

    # ---- page -------------------------------------------------------------------------------

    def _open_page(self, width: int, height: int) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def goto(self, url: str) -> None:
        since = len(self.events)
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", since=since)

    def eval(self, expression: str) -> Any:
        """Evaluate JS in the page and return its value (JSON-able); a thrown error raises."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise BrowserError(f"JS error: {d.get('exception', {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (press + release) at the centre of the first element matching selector."""
        box = self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + Math.min(r.width / 2, 40), r.top + r.height / 2]; })()"
        )
        if box is None:
            raise BrowserError(f"no element matches {selector}")
        x, y = box
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def type_into(self, selector: str, text: str) -> None:
        """Replace an input's value by typing, so the page sees real input events."""
        self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); e.select(); }})()")
        self.send("Input.insertText", {"text": text})

    def screenshot(self, path: str | Path, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            w, h = self.eval("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}
        data = self.send("Page.captureScreenshot", params)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def js_errors(self, since: int = 0) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries seen since event `since`."""
        out = []
        for ev in self.events[since:]:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif m == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
        return out

    def requested_urls(self) -> list[str]:
        return [ev["params"]["request"]["url"] for ev in self.events if ev.get("method") == "Network.requestWillBeSent"]

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        try:
            if not self._closed:
                self.send("Browser.close", session=False)
        except BrowserError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fd_above(fd: int, low: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, low)


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)
