package ledger_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/testenv"
)

// DeleteArtifacts removes each put's object under its own verified
// artifact.delete row. A put whose row cannot be written (its task removed
// meanwhile by another reconciler: the foreign key refuses the row) fails
// the batch of plans; the plans then run one by one, so that it fails
// alone and the others are deleted and verified (second review of the
// fifteenth session: one such put held back its whole batch).
func TestDeleteArtifactsFailsAPutAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDB(t)
	store, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var puts []ledger.Effect
	for i, doc := range []string{`{"a":1}`, `{"b":2}`} {
		data := []byte(doc)
		sum := sha256.Sum256(data)
		put := putOfStartedTask(t, db, doc, hex.EncodeToString(sum[:]), int64(len(data)))
		if _, _, err := ledger.Plan(ctx, db.Pool, put); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Put(put.Token, put.TaskID, put.Attempt, data); err != nil {
			t.Fatal(err)
		}
		puts = append(puts, put)
		if i == 0 {
			// The orphan sits between them.
			puts = append(puts, ledger.NewPut("task-removed-meanwhile", 1, put.RequestSHA256, put.RequestSize))
		}
	}
	ds, errs := ledger.DeleteArtifacts(ctx, db.Pool, store, nil, puts)
	for i, p := range puts {
		orphan := p.TaskID == "task-removed-meanwhile"
		if (errs[i] != nil) != orphan || (orphan && !errors.Is(errs[i], ledger.ErrTaskGone)) {
			t.Errorf("%s: error %v", p.Token, errs[i])
		}
		if !orphan && (!ds[i].Planned || !ds[i].Verified) {
			t.Errorf("%s: %+v, want its deletion planned and verified", p.Token, ds[i])
		}
		if !orphan {
			if gone, err := store.Gone(p.Token); !gone || err != nil {
				t.Errorf("%s: gone %v, %v", p.Token, gone, err)
			}
			if e := testenv.RequireEffect(t, db.Pool, ledger.KindArtifactDelete, ledger.DeleteToken(p.EffectID)); e.State != ledger.Verified {
				t.Errorf("%s: deletion %s, want verified", p.Token, e.State)
			}
		}
	}
}

// A batch that fails for a reason that is not one row's (here: the
// caller's context, cancelled) is not run again item by item: every put
// is ErrNotTried at once, for the next call to resume (second review: a
// shutdown during retention logged one warning per put).
func TestDeleteArtifactsStopsAtABatchWideFailure(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	store, err := artifact.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var puts []ledger.Effect
	for i := range 5 {
		doc := fmt.Sprintf(`{"n":%d}`, i)
		sum := sha256.Sum256([]byte(doc))
		puts = append(puts, putOfStartedTask(t, db, doc, hex.EncodeToString(sum[:]), int64(len(doc))))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, errs := ledger.DeleteArtifacts(ctx, db.Pool, store, nil, puts)
	for i, err := range errs {
		if !errors.Is(err, ledger.ErrNotTried) {
			t.Errorf("put %d: %v, want ErrNotTried", i, err)
		}
	}
}
