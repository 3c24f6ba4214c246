package agentcli

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// The agent asks the API server for protobuf (JSON as the fallback) and
// sends its merge patches as JSON: what a fleet of agents costs the API
// server to encode depends on it.
func TestClientAsksForProtobuf(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.Method+" accept"] = r.Header.Get("Accept")
		seen[r.Method+" content-type"] = r.Header.Get("Content-Type")
		mu.Unlock()
		w.Header().Set("Content-Type", runtime.ContentTypeJSON)
		if r.Method == http.MethodPatch {
			_, _ = w.Write([]byte(`{"kind":"Pod","apiVersion":"v1","metadata":{"name":"p","namespace":"n"}}`))
			return
		}
		_, _ = w.Write([]byte(`{"kind":"NamespaceList","apiVersion":"v1","items":[]}`))
	}))
	defer srv.Close()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	doc := "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: " + srv.URL + "}}]\n" +
		"users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
	if err := os.WriteFile(kubeconfig, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	e := enrollOptions{kubeconfig: kubeconfig, apiQPS: DefaultAPIQPS, apiBurst: 10}
	client, _, err := e.client(zap.NewNop(), "node-a", "--enrollment=kubernetes")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Namespaces().List(t.Context(), metav1.ListOptions{}); err != nil {
		t.Fatalf("list namespaces (a JSON answer must still be read): %v", err)
	}
	if _, err := client.CoreV1().Pods("n").Patch(t.Context(), "p", "application/merge-patch+json", []byte(`{"metadata":{}}`), metav1.PatchOptions{}); err != nil {
		t.Fatalf("patch: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := seen["GET accept"]; !strings.HasPrefix(got, runtime.ContentTypeProtobuf) || !strings.Contains(got, runtime.ContentTypeJSON) {
		t.Errorf("a list asks for %q, want protobuf first and JSON as the fallback", got)
	}
	if got := seen["PATCH content-type"]; got != "application/merge-patch+json" {
		t.Errorf("a merge patch is sent as %q", got)
	}
}
