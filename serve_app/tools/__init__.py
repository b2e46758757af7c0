"""Tools around the serving app, kept apart from its own modules: the demo, the
load and fault drills (``loadtest``), the request-path benchmark (``bench_http``
with its bare ``echo_app`` baseline) and the KubeRay config render (``k8s_render``).
Nothing in ``serve_app`` proper imports them."""
