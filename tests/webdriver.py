"""A headless Chromium driven over W3C WebDriver with the standard library (WebDriver is HTTP + JSON: no
selenium). Debian's `chromium` and `chromium-driver` (scripts/testbed-setup.sh installs both).

`Browser` starts chromedriver on a free 127.0.0.1 port, opens one session with a fresh profile and flags that keep
Chromium off the network (no sync, updates, QUIC or background requests), and quits both on `close()`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHROME_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1000"]


def browser_problems() -> list[str]:
    """What is missing to run a browser test (empty when nothing)."""
    return [f"{exe} not found (apt-get install chromium chromium-driver; scripts/testbed-setup.sh does)"
            for exe in ("chromium", "chromedriver") if shutil.which(exe) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Browser:
    def __init__(self) -> None:
        self.port = _free_port()
        self.profile = tempfile.mkdtemp(prefix="dash-chrome-")
        self.driver = subprocess.Popen(["chromedriver", f"--port={self.port}", "--allowed-ips=127.0.0.1"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        for _ in range(100):
            try:
                self._call("GET", "/status")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": shutil.which("chromium"), "args": [*CHROME_FLAGS, f"--user-data-dir={self.profile}"]}}}}
        self.session = self._call("POST", "/session", caps)["sessionId"]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())["value"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"webdriver {method} {path}: {exc.read()[:500]!r}") from None

    def _s(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._call(method, f"/session/{self.session}{path}", body)

    def get(self, url: str) -> None:
        self._s("POST", "/url", {"url": url})

    def js(self, script: str, *args: Any) -> Any:
        """Run `script` (a function body: `return ...`) in the page."""
        return self._s("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, *, timeout: float = 60.0, what: str = "") -> Any:
        """Poll `script` until it returns a truthy value; that value. Raises AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            value = self.js(script)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"browser: timed out waiting for {what or script} (last: {value!r}); page text: "
                             f"{str(self.js('return document.body.innerText'))[:1500]}")

    def click(self, css: str, *, attempts: int = 5) -> None:
        """Find and click `css`. A live page may redraw the element between the find and the click (a pushed
        update re-renders it: "stale element reference"): find it again, a few times."""
        for attempt in range(attempts):
            element = self._s("POST", "/element", {"using": "css selector", "value": css})
            try:
                self._s("POST", f"/element/{next(iter(element.values()))}/click", {})
                return
            except RuntimeError as exc:
                if "stale element reference" not in str(exc) or attempt == attempts - 1:
                    raise
                time.sleep(0.1)

    def accept_alert(self) -> None:
        """Press OK on the page's confirm() dialog."""
        self._s("POST", "/alert/accept", {})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._s("GET", "/screenshot")))

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, urllib.error.URLError, ConnectionError):
            self._s("DELETE", "")
        self.driver.terminate()
        try:
            self.driver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.driver.kill()
            self.driver.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
