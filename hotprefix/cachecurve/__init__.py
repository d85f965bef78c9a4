"""How the prefix cache's hit rate moves with its size: models of the engine's pool that
read a request log (no engine objects, no torch), for `hotprefix lint --curve`, `hotprefix
size --from-log` and the server's dashboard.

request.py: a request as the cache sees it; spatial.py: sampling a log by block hash;
stack_pass.py: one pass, every pool size (Mattson's stack algorithm on the pool's LRU);
policy_sim.py: the engine's policy at one size (the host tier, and the pass's checks);
curve.py: the curve of a log; advice.py: what it says in serve's flags, and its JSON.
"""
