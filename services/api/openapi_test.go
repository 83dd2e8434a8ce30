package api

import (
	"os"
	"strings"
	"testing"
)

// TestOpenAPIListsEveryCode keeps schemas/openapi.yaml in step with the
// problem codes the API can emit.
func TestOpenAPIListsEveryCode(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../../schemas/openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	spec := string(data)
	codes := []string{}
	for code := range kinds {
		codes = append(codes, code)
	}
	for code := range documentIJSONTitles {
		codes = append(codes, code)
	}
	for _, code := range codes {
		if !strings.Contains(spec, "            - "+code+"\n") {
			t.Errorf("openapi.yaml Problem.code enum lacks %s", code)
		}
	}
	for _, route := range []string{"  /v1/tasks:\n    post:", "  /v1/tasks/{id}:\n    get:", "  /v1/tasks/{id}/artifact:\n    get:", "  /healthz:\n    get:", "  /readyz:\n    get:", "  /metrics:\n    get:",
		"  /v1/admin/dead-letters:\n    get:", "  /v1/admin/dead-letters/{id}:\n    get:", "  /v1/admin/dead-letters/{id}/replay:\n    post:",
		"  /v1/admin/dead-letters/{id}/resolve:\n    post:", "  /v1/admin/outbox/parked:\n    get:", "  /v1/admin/outbox/{id}:\n    get:",
		"  /v1/admin/outbox/{id}/republish:\n    post:", "  /v1/admin/outbox/{id}/discard:\n    post:"} {
		if !strings.Contains(spec, route) {
			t.Errorf("openapi.yaml lacks %q", route)
		}
	}
}
