-- +goose Up
-- Issue 11: binaries from this migration on read artifact pack files
-- (internal/artifact: the objects a worker run writes share one file, so a
-- run takes one inode and one fsync instead of one per object), and the
-- one-object files of earlier releases. Binaries before it read only the
-- latter, so a binary writes packs only where the schema serves no binary
-- before 21: where schema_compatibility.oldest_binary is 21 or more
-- (schemas.Versions.ArtifactPacks). This migration leaves oldest_binary as
-- it is, so that a rollback to the previous release keeps reading every
-- artifact; `converge migrate --finalize` raises it once the upgrade is
-- done and no rollback is wanted (deploy/README.md, "Upgrades and
-- rollbacks"). `converge dev` finalizes its embedded database by itself,
-- not one given with --database-url.
COMMENT ON TABLE schema_compatibility IS 'oldest_binary: the oldest binary, by its highest migration, that this schema serves (schemas.Check). From 21 on, binaries write artifact pack files, which binaries before 21 cannot read.';

-- +goose Down
-- Once finalized, pack files may exist, which the binaries this schema
-- would then serve cannot read: refuse.
-- +goose StatementBegin
DO $$
BEGIN
  IF (SELECT oldest_binary FROM schema_compatibility) >= 21 THEN
    RAISE EXCEPTION 'schema_compatibility.oldest_binary is % (finalized): artifact pack files may exist, which binaries before migration 21 cannot read', (SELECT oldest_binary FROM schema_compatibility);
  END IF;
END
$$;
-- +goose StatementEnd
COMMENT ON TABLE schema_compatibility IS NULL;
