-- Variant B: nine secondary indexes of the hot tables that serve the
-- reconciler, retention and operators' queries dropped; the primary keys,
-- the outbox's unique (aggregate_id, aggregate_version, event_type), the
-- ledger's one-verified-put unique index and effect_ledger_task_idx (the
-- worker's live-effect lookup by task reads it: without it that lookup
-- scans the ledger) kept. Written against migration 21.
DROP INDEX task_nonterminal_idx, task_terminal_updated_idx,
  effect_ledger_unresolved_idx,
  inbox_message_processing_idx, idempotency_record_in_progress_idx,
  idempotency_record_expires_brin, outbox_event_created_brin,
  outbox_event_created_xid_idx, outbox_event_parked_idx;
