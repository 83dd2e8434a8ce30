package worker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
)

func TestRetryable(t *testing.T) {
	t.Parallel()
	_, canonErr := canon.Transform([]byte(`{"a":1,"a":1}`))
	_, decodeErr := taskevent.Decode([]byte(`{}`))
	for _, tc := range []struct {
		name      string
		err       error
		retryable bool
		code      string
	}{
		{"nil", nil, false, CodeUnclassified},
		{"deterministic", &DeterministicError{Code: CodeTaskNotFound, Err: errors.New("x")}, false, CodeTaskNotFound},
		{"wrapped deterministic", fmt.Errorf("process: %w", &DeterministicError{Code: CodeKeyMismatch, Err: errors.New("x")}), false, CodeKeyMismatch},
		{"canon error", fmt.Errorf("transform: %w", canonErr), false, canon.CodeDuplicateMemberName},
		{"invalid event", decodeErr, false, CodeInvalidEvent},
		{"invalid token", fmt.Errorf("head: %w", artifact.ErrInvalidToken), false, CodeArtifactTokenInvalid},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false, "SQLSTATE_23505"},
		{"check violation", fmt.Errorf("insert: %w", &pgconn.PgError{Code: "23514"}), false, "SQLSTATE_23514"},
		{"invalid text", &pgconn.PgError{Code: "22P02"}, false, "SQLSTATE_22P02"},
		{"serialization failure", &pgconn.PgError{Code: "40001"}, true, "SQLSTATE_40001"},
		{"deadlock", &pgconn.PgError{Code: "40P01"}, true, "SQLSTATE_40P01"},
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true, "SQLSTATE_57P01"},
		{"undefined table (migration missing)", &pgconn.PgError{Code: "42P01"}, true, "SQLSTATE_42P01"},
		{"deadline", fmt.Errorf("query: %w", context.DeadlineExceeded), true, CodeUnclassified},
		{"network", &net.OpError{Op: "dial", Err: errors.New("connection refused")}, true, CodeUnclassified},
		{"store timeout", artifact.ErrTimeout, true, CodeUnclassified},
		{"store i/o", fmt.Errorf("artifact write: %w", os.ErrPermission), true, CodeUnclassified},
		{"store not found after write", fmt.Errorf("read back: %w", artifact.ErrNotFound), true, CodeUnclassified},
		{"injected fault", fmt.Errorf("%s: %w", fault.WorkerAfterArtifactWrite, fault.ErrInjected), true, CodeUnclassified},
		{"concurrent change", fmt.Errorf("task: %w", errConcurrentChange), true, CodeUnclassified},
	} {
		if got := Retryable(tc.err); got != tc.retryable {
			t.Errorf("%s: Retryable(%v) = %v, want %v", tc.name, tc.err, got, tc.retryable)
		}
		if tc.err != nil {
			if got := ErrorCode(tc.err); got != tc.code {
				t.Errorf("%s: ErrorCode = %q, want %q", tc.name, got, tc.code)
			}
		}
	}
}
