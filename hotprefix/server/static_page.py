"""A static page of the package (the dashboards) as an HTML response with the headers a
page that shows operator data needs: a Content-Security-Policy that runs the page's own
inline scripts only (by their SHA-256), loads nothing from another origin, sends its
data requests to its own and may be framed by no site (frame-ancestors, and
X-Frame-Options for older browsers); nosniff; no referrer."""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from fastapi.responses import HTMLResponse

_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)
NONE = "'none'"


def page_headers(html: str) -> dict[str, str]:
    """The headers of `html`: its inline <script> blocks are the only code it may run."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                      for s in _SCRIPT.findall(html))
    csp = (f"default-src 'none'; script-src {hashes or NONE}; style-src 'unsafe-inline'; "
           "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer"}


@dataclass(frozen=True)
class StaticPage:
    html: str
    headers: dict[str, str]

    @classmethod
    def load(cls, package: str, name: str) -> StaticPage:
        """`name` (under the package's static/ folder, shipped in the wheel) and its headers."""
        html = resources.files(package).joinpath(f"static/{name}").read_text()
        return cls(html, page_headers(html))

    def response(self) -> HTMLResponse:
        return HTMLResponse(self.html, headers=self.headers)
