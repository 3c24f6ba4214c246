package cniplugin

import (
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// TestEveryConfigFieldDocumented keeps the plugin configuration table of docs/configuration.md
// and the plugin's own config fields equal.
func TestEveryConfigFieldDocumented(t *testing.T) {
	documented := fixtures.DocNames(t, "docs/configuration.md", regexp.MustCompile("(?m)^\\| `([a-zA-Z./-]+)` \\|"))
	typ := reflect.TypeFor[NetConf]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		if f.Anonymous {
			continue // the CNI spec's own fields
		}
		name := strings.Split(f.Tag.Get("json"), ",")[0]
		if strings.HasPrefix(name, "cni.dev/") {
			continue // set by the runtime, not by operators
		}
		if !documented[name] {
			t.Errorf("config field %q is not in the plugin configuration table of docs/configuration.md", name)
		}
	}
}
