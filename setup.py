"""Packaging glue that pyproject.toml cannot express: the migrations ship inside the wheel.

Alembic's scripts stay in the repository's top-level ``alembic/`` (where the `alembic` tool
and `alembic.ini` expect them, a fixed choice); the wheel carries them as the package
``llmgw._alembic``, so an installed control plane can migrate its database; ``config/``
(the demo, the example configuration) ships likewise as ``llmgw._config``. pyproject.toml can
map a folder to a package name (package-dir) but not add that mapped package to the ones
``packages.find`` discovers, so the list is made here; everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["llmgw", "llmgw.*"]),
        "llmgw._alembic",
        "llmgw._alembic.versions",
        "llmgw._config",
    ],
    # The demo `llmgw up` applies and the example configuration ship too: an installed llmgw
    # must bring up its demo without a checkout.
    package_dir={"llmgw._alembic": "alembic", "llmgw._config": "config"},
    package_data={
        # The tiny model's tokenizer files (scripts/make-tiny-model.py).
        "llmgw": ["py.typed", "tinymodel/*.json"],
        # The web console's templates and its static files (vendored htmx and uPlot with their
        # licences): served from the package, no CDN.
        "llmgw.controlplane.console": [
            "templates/*.html",
            "static/*.css",
            "static/*.js",
            "static/vendor/*",
        ],
        "llmgw._alembic": ["script.py.mako"],
        "llmgw._config": ["*.yaml", "*.toml", "*.service", "examples/*.yaml"],
    },
)
