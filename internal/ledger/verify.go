package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
)

// Verify is the read-back check of seed 7.1 for an artifact.put: the object
// read back under e's token names e's task and attempt in its metadata, and
// the bytes actually stored have e's request size and SHA-256 (as does the
// metadata). The worker calls it after every write and the reconciler when
// it resolves an effect whose outcome is not known.
func Verify(obs artifact.Observation, e Effect) bool {
	return obs.Meta.TaskID == e.TaskID && obs.Meta.Attempt == e.Attempt &&
		obs.Size == e.RequestSize && obs.SHA256 == e.RequestSHA256 &&
		obs.Meta.Size == e.RequestSize && obs.Meta.SHA256 == e.RequestSHA256
}

// Compensation is how Compensate ended.
type Compensation struct {
	// HideID is the compensation's effect id (CompensationToken).
	HideID string
	// HidePlanned: this call wrote the compensation's ledger row.
	HidePlanned bool
	// HideVerified: this call moved the compensation to verified.
	HideVerified bool
	// Observed: the object was already gone when observed first — a hide
	// whose call timed out had happened (seed 14, "compensation times
	// out"); it was verified, not done again.
	Observed bool
	// Applied: the effect moved compensation_required -> compensated; false
	// when it had moved already (a concurrent compensation).
	Applied bool
}

// Compensate undoes the object of effect e, which is compensation_required
// (seed 8): a ledger row of kind artifact.hide with token
// CompensationToken(e.EffectID) is written first (NewCompensation, with the
// object's SHA-256 as observed, else the request's, and observedSize bytes);
// unless that compensation is verified already, the store is observed under
// e's token — an object already gone is taken as hidden — and otherwise
// hidden, and observing it must then find it gone; the compensation moves to
// verified and e to compensated, each by compare-and-set. An error leaves e
// compensation_required, to be compensated again by the same protocol (the
// reconciler's scan); it never hides twice what is already gone.
func Compensate(ctx context.Context, q dbpool.Querier, store *artifact.Store, e Effect, observedSize int64) (Compensation, error) {
	sha := e.RequestSHA256
	if e.ObservedSHA256 != nil {
		sha = *e.ObservedSHA256
	}
	var c Compensation
	h, planned, err := Plan(ctx, q, NewCompensation(e, sha, observedSize))
	if err != nil {
		return c, err
	}
	c.HideID, c.HidePlanned = h.EffectID, planned
	if h.State != Verified {
		_, err := store.Head(e.Token)
		switch {
		case errors.Is(err, artifact.ErrNotFound):
			c.Observed = true
		case err != nil:
			return c, fmt.Errorf("observe artifact %s before hiding it: %w", e.Token, err)
		default:
			if err := store.Hide(e.Token); err != nil {
				return c, fmt.Errorf("hide artifact %s: %w", e.Token, err)
			}
			if _, err := store.Head(e.Token); !errors.Is(err, artifact.ErrNotFound) {
				return c, fmt.Errorf("artifact %s still readable after hide (%v)", e.Token, err)
			}
		}
		if c.HideVerified, err = MarkVerified(ctx, q, h.EffectID, h.State, nil); err != nil {
			return c, err
		}
	}
	if c.Applied, err = MarkCompensated(ctx, q, e.EffectID); err != nil {
		return c, err
	}
	return c, nil
}
