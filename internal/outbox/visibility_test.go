package outbox

import (
	"strconv"
	"testing"
)

func TestSnapshotVisible(t *testing.T) {
	t.Parallel()
	const epoch = uint64(3) << 32
	tests := []struct {
		name string
		snap string
		xid  uint32
		want bool
	}{
		{"below xmin", "100:200:", 50, true},
		{"between, not in progress", "100:200:150", 120, true},
		{"in progress", "100:200:120,150", 120, false},
		{"at xmax: not started for the snapshot", "100:200:", 200, false},
		{"above xmax", "100:200:", 300, false},
		{"epoch taken from xmax", fmtSnap(epoch+100, epoch+200, epoch+150), 150, false},
		{"epoch taken from xmax, finished", fmtSnap(epoch+100, epoch+200), 140, true},
		{"xid of the epoch before xmax's (wrapped)", fmtSnap(epoch-10, epoch+5, epoch-3), 0xffffffff - 2, false},
		{"xid of the epoch before xmax's, finished", fmtSnap(epoch-10, epoch+5), 0xffffffff - 20, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := parseSnapshot(tc.snap)
			if err != nil {
				t.Fatal(err)
			}
			if got := s.visible(tc.xid); got != tc.want {
				t.Fatalf("visible(%d) in %s = %v, want %v", tc.xid, tc.snap, got, tc.want)
			}
		})
	}
	for _, bad := range []string{"", "1:2", "a:2:", "1:b:", "1:2:x"} {
		if _, err := parseSnapshot(bad); err == nil {
			t.Errorf("parseSnapshot(%q) = nil error", bad)
		}
	}
}

func fmtSnap(xmin, xmax uint64, xip ...uint64) string {
	s := strconv.FormatUint(xmin, 10) + ":" + strconv.FormatUint(xmax, 10) + ":"
	for i, x := range xip {
		if i > 0 {
			s += ","
		}
		s += strconv.FormatUint(x, 10)
	}
	return s
}
