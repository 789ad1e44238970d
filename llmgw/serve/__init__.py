"""The control plane process: its parts built once and handed to both listeners' apps.

``llmgw.gateway`` (the public OpenAI listener) and ``llmgw.controlplane`` (the internal
listener: admin API, agent API, console, the leader's reconciler) never import each other;
this package is the one place that imports both (docs/packages.md).
"""
