#!/bin/sh
# Runs once when the PostgreSQL volume is initialised (docker-entrypoint-initdb.d).
# converge's role: LOGIN + REPLICATION (the relay streams from a logical
# replication slot), owner of its database (migrations create the tables, so
# converge owns outbox_event and may create the publication on it). Not a
# superuser. Its password comes from CONVERGE_DB_PASSWORD (deploy/.env).
set -eu
psql -v ON_ERROR_STOP=1 -v pw="$CONVERGE_DB_PASSWORD" --username "$POSTGRES_USER" --dbname postgres <<'EOSQL'
CREATE ROLE converge LOGIN REPLICATION PASSWORD :'pw';
CREATE DATABASE converge OWNER converge;
EOSQL
