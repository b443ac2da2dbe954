"""The dashboard: the KV pool block by block, the engine over time, the live requests and the
advisor's verdict, for a server (`pagedserve serve`) or a simulated run (`simulate --dashboard`).

    feed.py     the front-end's side: steps and pool snapshots in, series, verdict and frames out
    routes.py   /dashboard, its assets (static/) and SSE stream; `mount_dashboard` plugs it into a server
    replay.py   a simulated run paced into the same page

It stands above the engine and the advisor and below the server and the simulator's CLI, which
plug it in. The pool snapshot itself (core/snapshot.py) stays in the core: the engine-core loop
and the simulator take it, and the wire carries it.
"""
