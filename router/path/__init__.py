"""The request path: one proxied request from its ASGI scope to its last byte.

Owns building a request (``request``: key, body, model, headers), forwarding it (``proxy``:
admission slot, backend lease, the exchange), the upstream exchange and what happens when the
process dies under it (``recovery``, with ``blame`` deciding retry, resume or naming the
request), relaying the answer (``relay``; ``framing`` says how each protocol's stream ends),
resuming a cut stream on a fresh process (``resume``, ``resume_anthropic``) and the
cold-start feedback while a model loads (``loading``).

Imports: ``router.edge``, ``router.state`` and procman, never
``router.api``: routes call the path, the path never knows which route called it.
"""
