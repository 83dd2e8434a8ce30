package clientid

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

func TestProcess(t *testing.T) {
	t.Parallel()
	id := Process("converge-worker")
	if !strings.HasPrefix(id, "converge-worker-") || !strings.HasSuffix(id, "-"+strconv.Itoa(os.Getpid())) {
		t.Errorf("Process = %q, want converge-worker-<host>-%d", id, os.Getpid())
	}
	if strings.ContainsAny(id, " /:") {
		t.Errorf("Process = %q contains characters outside [A-Za-z0-9._-]", id)
	}
}

func TestSanitize(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"build7":            "build7",
		"web-1.example.org": "web-1.example.org",
		"my host/ä":         "my_host__",
	} {
		if got := sanitize(in); got != want {
			t.Errorf("sanitize(%q) = %q, want %q", in, got, want)
		}
	}
}
