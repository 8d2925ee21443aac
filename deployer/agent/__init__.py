"""ddeploy's host-side agent: one transaction per host per command (stdlib only, Python >= 3.8).

Prints one JSON object on stdout ({"ok": true, ...} or {"ok": false, "error": {"kind", "message"}})
and progress lines on stderr. OPs: status, state, plan, push, rollback, log, lock-status,
lock-release, push-build (deploys), sources, build (kernel builds), test (overlay tests), launch,
logs, stop, wait, drain, health, bench, bench-save (launched servers). The client runs it as
`python -S -c BOOTSTRAP OP DIGEST`: the host keeps this package compiled under DIGEST, the sha256
of its bundle of module sources, which the client sends on stdin only when the host does not have
it yet; the JSON request (one line) follows on stdin, which the client keeps open until the reply:
end of file there means the client has gone (client.py) (deployer/transport/agent_client.py,
boot.py); `python -m deployer.agent OP` with the request on stdin runs it too. The reply shapes are
the pydantic models of deployer/transport/protocol.py.

Why one program on the host: a push is a single round trip and a single transaction. Patch
commits are built in a private index (the work tree is untouched until they all exist), the switch
of the work tree is idempotent (per-file checkout of the target commit), and a journal written
before the switch lets any later run roll it forward. SIGHUP/SIGPIPE are ignored so a cut SSH
connection does not stop a transaction halfway. The state record's compare-and-swap on
refs/ddeploy/state is the commit point.

This program alone reads and writes the host's records (the client only sees its replies):
    refs/ddeploy/state      a chain of commits (parent = the previous record) whose tree holds one
                            file, state.json; every change is a new commit installed with a
                            compare-and-swap, so concurrent writers never lose each other's
                            updates, and the chain is the history (`ddeploy log`)
    refs/ddeploy/versions/V head commit of version V as last applied (`rollback --to V`)
    refs/ddeploy/pre-deploy the recorded pre-deploy commit while a version is applied
    refs/ddeploy/saved/*    hand edits saved by --force, shaped like a stash entry: the work-tree
                            version, parents the HEAD they were on and the index version (^2)
    .git/ddeploy/deploy.lock  the checkout's lock: fcntl.flock held by the agent for the whole
                            operation, released by the kernel when it ends or dies (no stale lock)
    .git/ddeploy/deploy.lock.held  flock'ed exclusively by the holder too, so status can probe it
                            (a shared flock for an instant) without ever touching deploy.lock
    .git/ddeploy/deploy.lock.json  the holder's record {by, user, host, pid, time, command}, for
                            messages; one left by a killed holder is replaced by the next command
    .git/ddeploy/journal.json  a transaction switched halfway; the next run rolls it forward
    .git/ddeploy/sets/      shipped patch sets; test-reports/, pycache/ (kept out of the work tree;
                            a push or rollback drops the bytecode of the files it switches)
    ~/.cache/ddeploy/launches/launch.json   the host's last launch (id, topology, scripts dir,
                            units with pid, start time, log, state), replaced by compare-and-swap
                            on its id, whatever launch_dir it used ($DDEPLOY_CACHE_DIR/launches)
    ~/.cache/ddeploy/launches/launch.lock   the launch lock: flock held by launch, stop, wait and
                            bench for their whole work (launch.lock.json: its holder, for messages)
    <launch_dir>/<topology>/   a launch's scripts, env files and logs
state.json (schema 1; absent keys mean "never happened"): applied {name, version, fingerprint,
patches [{name, sha256, commit}], files, head, tree, three_way, dev, by, at} (dev: a dev snapshot
of the overlay, not a release), pre_deploy {commit, tree, branch}, last {action, version, dev,
from, by, at, saved}, builds {arch: {ok, nvcc, cuda_home,
source_hash, cache_dir, version, at, modules, known}}, tests {ok, rc, version, k, at, report,
tests, passed, failed, errors, skipped, duration, summary}; the client's models of these are in
deployer/transport/protocol.py.

One module per concern: common (errors, progress), repo (git), state (the state record), lock
(and mounts, the filesystem its errors name), transaction (journal and switch), patch_files (the
set's patches on the host), base_gate, facts, plan and plan_diff, push (and pruning of dev
snapshots), rollback, status, history (log), lock_commands, toolkit, build_plan, jit_cache and
build (kernels), overlay_tests (pytest), bytecode (its cache), launch_record (the launch record
and lock), units (unit files and processes), launch, serving (is it serving), serving_checks
(drain, health: is it idle, does it generate), router (a unit out of and back into its SGLang
router) and bench (servers), client (is the client still
there), main (the entry point: each operation's module imported when it runs), boot
(imports the bundle's compiled modules on the host). The modules import each other relatively,
so the package runs under any name (`ddeploy_agent` on the host).
"""
