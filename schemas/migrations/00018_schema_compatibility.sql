-- +goose Up
-- Issue 11: binaries and schemas of different releases meet during an
-- upgrade (deploy/README.md, "Upgrades"): `converge migrate` of a release
-- runs while the previous release's components still run, and a rollback
-- runs the previous release's binaries against the new schema. A release's
-- schema therefore serves the previous release's binaries; a migration that
-- removes what older binaries still use (an index their ON CONFLICT names,
-- a column they read) raises oldest_binary to the first binary that no
-- longer uses it, and lands one release after that binary.
--
-- oldest_binary is a binary's schema version: the highest migration it
-- embeds. Binaries from this migration on read the row when they start
-- (schemas.Check) and refuse to run, with ErrBinaryTooOld, below it, and
-- with ErrSchemaBehind on a database that lacks their own migrations.
-- Binaries before this migration do not check.
--
-- 16: the oldest binary a test shows this schema serving (the ledger's
-- plan insert of binaries before 00017, TestSchemaServesBinariesBefore00017).
CREATE TABLE schema_compatibility (
  only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
  oldest_binary bigint NOT NULL CHECK (oldest_binary >= 0)
);
INSERT INTO schema_compatibility (oldest_binary) VALUES (16);

-- +goose Down
DROP TABLE schema_compatibility;
