"""MkDocs hook: pages generated from the code when the site builds, so they cannot drift from it.

- ``reference/configuration.md``: every configuration key of a run and of each installed plugin
  (:func:`core_rl.config.reference.reference_markdown`).
"""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: object) -> Files:
    from core_rl.config.reference import reference_markdown

    files.append(File.generated(config, "reference/configuration.md", content=reference_markdown()))
    return files
