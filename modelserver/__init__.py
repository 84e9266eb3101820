"""The per-model server, ``python -m modelserver`` (see :mod:`modelserver.cli`).

Importing this package stays cheap: no engine (OpenVINO) is imported until a model loads.
The router imports only :mod:`modelserver.spec`.
"""

__all__: list[str] = []
