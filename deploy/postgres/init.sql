-- Runs once when the PostgreSQL volume is initialised (docker-entrypoint-initdb.d).
-- converge's role: LOGIN + REPLICATION (the relay streams from a logical
-- replication slot), owner of its database (migrations create the tables, so
-- converge owns outbox_event and may create the publication on it). Not a
-- superuser. Change the password (and CONVERGE_DATABASE_URL) for real use.
CREATE ROLE converge LOGIN REPLICATION PASSWORD 'converge';
CREATE DATABASE converge OWNER converge;
