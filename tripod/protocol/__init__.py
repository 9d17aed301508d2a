"""tripod's messages: everything that crosses a process or network boundary, as typed structs.

Torch-free and at the bottom of the package map (server, router, console and chains import it;
it imports nothing of theirs). One module per edge:

- ``sampling``: ``SamplingParams``, ``GrammarSpec``, ``Resume`` (carried by ``AddRequest``);
- ``engine_ipc``: the server ⇄ engine-process pipes (ZMQ) and their one codec (msgpack, tagged);
- ``stats``: the engine's stats snapshot (heartbeats, ``/debug/engine``), typed and versioned;
- ``failover``: the resume points a replica reports and the router reads (JSON over HTTP);
- ``chains``: a chainlet's call, answer, stream end and error bodies (JSON over HTTP).

Decoding validates: a message that does not match its type is refused with the path of what is
wrong, never read by key on the other side.

NOTE: this file imports none of its submodules, so each edge loads only what it uses (and
engineers adding an edge never edit the same lines).
"""
