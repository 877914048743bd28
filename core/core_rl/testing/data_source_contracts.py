"""Contract test class of data sources (see :mod:`core_rl.testing` and :mod:`core_rl.data.sources`).

A source's tests set ``options`` (its section without ``name``) and optionally ``expected_rows``
(how many rows those options make) and ``columns`` (columns every row must hold besides the prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from core_rl.config.plugin_spec import PluginSpec
from core_rl.config.sections import validate_plugin_section
from core_rl.data.files import read_data_files
from core_rl.data.prompts import check_rows
from core_rl.data.sources import DataSource
from core_rl.plugins.kinds import DATA_SOURCE
from core_rl.testing.contracts import ComponentContract


class DataSourceContract(ComponentContract):
    """Set ``options``; ``expected_rows`` (``None``: not checked), ``prompt_key`` and ``columns``."""

    kind = DATA_SOURCE
    expected_rows: ClassVar[int | None] = None
    prompt_key: ClassVar[str] = "prompt"
    columns: ClassVar[list[str]] = []

    def build(self) -> DataSource:
        return self.entry().factory(self.config())

    def test_rows_are_mappings_holding_a_prompt_and_the_columns(self) -> None:
        rows = list(self.build().rows())
        assert rows, "the source made no rows"
        if self.expected_rows is not None:
            assert len(rows) == self.expected_rows
        assert all(isinstance(row, Mapping) for row in rows), "DataSource.rows returns mappings"
        spec = self._spec()
        read, problems = read_data_files(["source:s"], sources={"s": spec})
        readers = {column: "the contract's columns" for column in self.columns}
        problems += check_rows(read, self.prompt_key, readers, chat_template=True)
        assert problems == []

    def test_the_same_rows_in_the_same_order_on_every_call_and_build(self) -> None:
        """What a resumed run relies on: building the source again gives the same rows."""
        source = self.build()
        first = list(source.rows())
        assert list(source.rows()) == first
        assert list(self.build().rows()) == first

    def test_rows_reach_the_run_as_the_source_made_them(self) -> None:
        """No JSON round trip: read through ``data.train_files``, each row is equal to the source's
        and its values keep their Python types (a tuple stays a tuple)."""
        made = list(self.build().rows())
        read, problems = read_data_files(["source:s"], sources={"s": self._spec()})
        assert problems == []
        assert [r.row for r in read] == made
        for r, row in zip(read, made):
            assert {k: type(v) for k, v in r.row.items()} == {k: type(v) for k, v in row.items()}
        assert [r.where for r in read[:2]] == [f"source:s row {i}" for i in range(1, min(2, len(read)) + 1)]

    def _spec(self) -> PluginSpec:
        spec = PluginSpec(name=self.name, options=dict(self.options))
        validate_plugin_section(self.host(), self.kind, spec, "data.sources.s")
        return spec
