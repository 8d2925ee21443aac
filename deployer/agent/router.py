"""`router`: take the host's serving units out of the SGLang router in front of them, or put them
back (`ddeploy rollout`: out before a unit is drained, back once it serves again and passed).

The router is SGLang's Model Gateway (sglang_router): its workers API lists `GET /workers`
({"workers": [{"id", "url", ...}]}), adds `POST /workers` ({"url": ...}) and removes
`DELETE /workers/<id>`; both changes are queued jobs there, so this operation polls the list
until the change shows. A router without that API (older sglang_router) gets the legacy calls,
`POST /remove_worker?url=` and `POST /add_worker?url=`. Each unit's worker URL is the client's
template (the inventory's `router.worker_url`, `{port}` replaced by the unit's port): the address
the router reaches the host at, which the host itself may not know. Runs under the launch lock.
"""

import json
import time
import urllib.error
import urllib.parse
import urllib.request

from .common import Fail, progress
from .repo import Repo
from .serving_checks import serving_units

POLL = 0.5


def call(method: str, url: str, body=None, timeout: float = 10.0):
    """(HTTP status, parsed JSON or None); an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)  # noqa: S310 - http(s) checked
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 - the inventory's router
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, None


def listed(router: str):
    """{worker url: id} the router lists; None when it has no workers API (a legacy router)."""
    status, reply = call("GET", router + "/workers")
    if status == 404:
        return None
    if status != 200 or not isinstance(reply, dict):
        raise Fail("RemoteCommandError", "the router %s answered GET /workers with HTTP %d" % (router, status))
    workers = reply.get("workers") or []
    return {w.get("url"): w.get("id") for w in workers if isinstance(w, dict)}


def change(router: str, worker: str, action: str, deadline: float) -> str:
    """Remove or add one worker and wait until the router's list shows it; what was done."""
    now = listed(router)
    if now is None:  # the legacy API: synchronous
        path = "/remove_worker" if action == "remove" else "/add_worker"
        status, _ = call("POST", router + path + "?" + urllib.parse.urlencode({"url": worker}))
        if status >= 300:
            raise Fail("RemoteCommandError", "the router %s refused %s %s: HTTP %d" % (router, path, worker, status))
        return "%s (legacy %s)" % (action, path)
    if (worker in now) == (action == "add"):
        return "already %s" % ("registered" if action == "add" else "not registered")
    if action == "remove":
        status, _ = call("DELETE", router + "/workers/" + urllib.parse.quote(str(now[worker]), safe=""))
    else:
        status, _ = call("POST", router + "/workers", {"url": worker})
    if status >= 300:
        raise Fail("RemoteCommandError", "the router %s refused to %s %s: HTTP %d" % (router, action, worker, status))
    while (worker in (listed(router) or {})) != (action == "add"):
        if time.monotonic() > deadline:
            raise Fail(
                "RemoteCommandError",
                "the router %s accepted to %s %s but does not show it after the timeout" % (router, action, worker),
            )
        time.sleep(POLL)
    return action


def op_router(repo: Repo, req: dict) -> dict:
    router, template, action = req["router"].rstrip("/"), req["worker_url"], req["action"]
    if action not in ("remove", "add"):
        raise Fail("UsageError", "router action must be remove or add, not %r" % action)
    deadline = time.monotonic() + float(req.get("timeout", 60))
    done = []
    for unit in serving_units(req):
        port = urllib.parse.urlsplit(unit["url"]).port
        worker = template.replace("{port}", str(port))
        try:
            what = change(router, worker, action, deadline)
        except (urllib.error.URLError, OSError) as exc:
            raise Fail("ConnectError", "cannot reach the router %s from this host: %s" % (router, exc)) from None
        progress("router %s: %s %s" % (router, what, worker))
        done.append({"unit": unit["name"], "worker": worker, "done": what})
    return {"ok": True, "workers": done}
