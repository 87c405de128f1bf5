"""The traffic record's fields are defined once, by the contract (`contracts.traffic`): the
Console's table, its bulk-insert column list and the API's response model follow it exactly (plus
what the Console adds: the shipping Security CVM, and the table's arrival time)."""

from __future__ import annotations

from umbra.console import traffic_store
from umbra.console.models import TrafficRecord as Table
from umbra.console.schemas import TrafficRecordOut
from umbra.contracts.traffic import TrafficRecord as Contract

CONTRACT = set(Contract.model_fields)


def test_the_table_is_the_contract_plus_what_the_console_adds() -> None:
    columns = set(Table.__table__.c.keys())  # type: ignore[attr-defined]
    assert columns == CONTRACT | {"security_cvm_id", "received_at", "export_seq"}


def test_the_insert_columns_are_derived_from_the_contract() -> None:
    assert tuple(Contract.model_fields) == traffic_store.RECORD_COLUMNS
    assert {*traffic_store.COLUMNS, "export_seq"} == set(Table.__table__.c.keys())  # type: ignore[attr-defined]
    assert traffic_store.JSON_COLUMNS <= CONTRACT


def test_the_response_model_is_the_contract_plus_the_shipper() -> None:
    assert set(TrafficRecordOut.model_fields) == CONTRACT | {"security_cvm_id"}
