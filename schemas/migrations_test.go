package schemas_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/testenv"
)

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// insertOutbox inserts an outbox row whose payload is the text given.
func insertOutbox(ctx context.Context, db *testenv.DB, id, payload, sha string) error {
	_, err := db.Pool.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ($1, $1, 0, 'TaskCreated', $2, $3)`, id, payload, sha)
	return err
}

// payloadColumn returns the type of outbox_event.payload and whether the
// JSON check constraint exists.
func payloadColumn(t *testing.T, db *testenv.DB) (typ string, check bool) {
	t.Helper()
	ctx := context.Background()
	if err := db.Pool.QueryRow(ctx, `SELECT data_type FROM information_schema.columns
WHERE table_schema = 'public' AND table_name = 'outbox_event' AND column_name = 'payload'`).Scan(&typ); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_constraint
WHERE conrelid = 'public.outbox_event'::regclass AND conname = 'outbox_event_payload_json_check')`).Scan(&check); err != nil {
		t.Fatal(err)
	}
	return typ, check
}

// TestOutboxPayloadMustBeJSON: the text payload keeps the guarantee of the
// jsonb column it replaced (migration 00004): what jsonb refuses is refused,
// and the text is stored as given.
func TestOutboxPayloadMustBeJSON(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := context.Background()
	for i, bad := range []string{``, `not json`, `{"a":`, `{"a":1}x`, `"\u0000"`, `"\ud800"`} {
		err := insertOutbox(ctx, db, "bad-"+testenv.Itoa(i), bad, sum([]byte(bad)))
		var pgErr *pgconn.PgError
		// PostgreSQL 15 raises the cast's error (22P02, or 22P05 for an
		// unsupported escape) while it evaluates the CHECK; a check
		// violation (23514) would do as well.
		if !errors.As(err, &pgErr) || (pgErr.Code != "22P02" && pgErr.Code != "22P05" && pgErr.Code != "23514") {
			t.Errorf("payload %q: insert = %v, want it refused", bad, err)
		}
	}
	for i, good := range []string{`{"a":2,"b":1}`, `{"b": 1, "a": 2}`, ` [1, 2.50] `, `null`} {
		id := "good-" + testenv.Itoa(i)
		if err := insertOutbox(ctx, db, id, good, sum([]byte(good))); err != nil {
			t.Fatalf("payload %q: %v", good, err)
		}
		var stored string
		if err := db.Pool.QueryRow(ctx, `SELECT payload FROM outbox_event WHERE outbox_id = $1`, id).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		if stored != good {
			t.Errorf("stored %q, want the text as given %q", stored, good)
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE outbox_id LIKE 'bad-%'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d refused rows stored (%v)", n, err)
	}

	// A writer of before 00004 casts the payload to jsonb: PostgreSQL
	// assigns it to the text column as jsonb's rendering.
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256)
VALUES ('old-writer', 'old-writer', 0, 'TaskCreated', $1::jsonb, $2)`, `{"b":1,"a":2}`, sum([]byte(`{"a":2,"b":1}`))); err != nil {
		t.Fatalf("insert with a jsonb cast: %v", err)
	}
	var stored string
	if err := db.Pool.QueryRow(ctx, `SELECT payload FROM outbox_event WHERE outbox_id = 'old-writer'`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if stored != `{"a": 2, "b": 1}` {
		t.Errorf("jsonb-cast payload stored as %q, want jsonb's rendering", stored)
	}
}

// TestPayloadMigrationDownUp: on a database with outbox rows and a
// publication, 00004 goes down (text -> jsonb) and up again (jsonb -> text):
// no row is lost, every payload keeps its canonical form, the publication
// still covers outbox_event.
func TestPayloadMigrationDownUp(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := context.Background()
	p := db.Migrations(t)
	if v, err := p.GetDBVersion(ctx); err != nil || v < 4 {
		t.Fatalf("database version %d (%v), want at least 4", v, err)
	}
	if _, err := db.Pool.Exec(ctx, "CREATE PUBLICATION p_"+db.Name+" FOR TABLE public.outbox_event WITH (publish = 'insert')"); err != nil {
		t.Fatal(err)
	}

	canonical := map[string]string{} // outbox id -> canonical payload
	for i, payload := range []string{`{"a":2,"b":1}`, `{"b": 1, "a": [1.0, "x"]}`, `{"task":{"status":"queued"},"event_id":"e"}`} {
		id := "row-" + testenv.Itoa(i)
		c, s, err := taskevent.Canonical([]byte(payload))
		if err != nil {
			t.Fatal(err)
		}
		if err := insertOutbox(ctx, db, id, payload, s); err != nil {
			t.Fatal(err)
		}
		canonical[id] = string(c)
	}
	check := func(step, wantType string, wantCheck bool) {
		t.Helper()
		if typ, c := payloadColumn(t, db); typ != wantType || c != wantCheck {
			t.Fatalf("%s: payload %s, JSON check %v; want %s, %v", step, typ, c, wantType, wantCheck)
		}
		rows, err := db.Pool.Query(ctx, `SELECT outbox_id, payload::text, payload_sha256 FROM outbox_event`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		n := 0
		for rows.Next() {
			var id, payload, sha string
			if err := rows.Scan(&id, &payload, &sha); err != nil {
				t.Fatal(err)
			}
			c, s, err := taskevent.Canonical([]byte(payload))
			if err != nil || string(c) != canonical[id] || s != sha {
				t.Errorf("%s: row %s payload %s canonicalizes to %s (%v), want %s", step, id, payload, c, err, canonical[id])
			}
			n++
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if n != len(canonical) {
			t.Fatalf("%s: %d rows, want %d", step, n, len(canonical))
		}
		var published bool
		if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication_tables
WHERE pubname = $1 AND schemaname = 'public' AND tablename = 'outbox_event')`, "p_"+db.Name).Scan(&published); err != nil {
			t.Fatal(err)
		}
		if !published {
			t.Fatalf("%s: the publication no longer covers outbox_event", step)
		}
	}
	check("up", "text", true)
	if _, err := p.DownTo(ctx, 3); err != nil {
		t.Fatalf("down to 3: %v", err)
	}
	check("down", "jsonb", false)
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("up again: %v", err)
	}
	check("up again", "text", true)
	if err := insertOutbox(ctx, db, "bad", "not json", sum([]byte("not json"))); err == nil {
		t.Fatal("non-JSON payload accepted after up again")
	}
}
