"""The client-facing APIs: every route but the proxy itself, and what the operator sees.

Owns ``/v1/models`` and the llama.cpp model API (``clientapi``, ``modelstatus``), the
Responses API's state (``responses``, ``responses_store``), Ollama's API (``ollama``,
``ollama_cards``), ``/api`` management (``management``), the dashboard and its event stream
(``ui_routes`` serving ``router/ui/``, ``events``, ``console``), per-request figures
(``activity``), CORS (``cors``) and ``endpoint`` (the one ASGI endpoint every proxied route
shares).

Imports: ``router.edge``, ``router.state``, ``router.path`` and the root's ``service``
(the running router these routes read). Nothing below imports this package; ``router.app``
and ``router.service`` assemble it.
"""
