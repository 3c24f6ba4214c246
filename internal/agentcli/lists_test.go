package agentcli

import (
	"strings"
	"testing"
)

// TestProbeListFlags: --probe-sources and --probe-cgroups take "none" alone
// as the empty list and refuse it among other items, and each refuses the
// items it cannot use.
func TestProbeListFlags(t *testing.T) {
	for _, c := range []struct {
		flag interface {
			Set(string) error
			String() string
		}
		in, want, wantErr string
	}{
		{&probeSourceList{}, "none", "none", ""},
		{&probeSourceList{}, "", "none", ""},
		{&probeSourceList{}, "10.1.0.0/16, 192.168.1.7/24", "10.1.0.0/16,192.168.1.0/24", ""},
		{&probeSourceList{}, "10.1.0.0/16,none", "", `"none" cannot be combined with other probe sources`},
		{&probeSourceList{}, "node", "", `"node" is no longer a probe source`},
		{&probeSourceList{}, "10.1.0.0", "", "is not a CIDR"},
		{&probeCgroupList{}, "none", "none", ""},
		{&probeCgroupList{}, "kubelet", "kubelet", ""},
		{&probeCgroupList{}, "/a.slice,/b.slice", "/a.slice,/b.slice", ""},
		{&probeCgroupList{}, "none,kubelet", "", `"none" cannot be combined with other probe cgroups`},
		{&probeCgroupList{}, "kubelet,/a.slice", "", `"kubelet" cannot be combined with cgroup paths`},
		{&probeCgroupList{}, "a.slice", "", "want kubelet or an absolute cgroup path"},
	} {
		err := c.flag.Set(c.in)
		switch {
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%T.Set(%q) = %v, want an error with %q", c.flag, c.in, err, c.wantErr)
		case c.wantErr == "" && err != nil:
			t.Errorf("%T.Set(%q): %v", c.flag, c.in, err)
		case c.wantErr == "" && c.flag.String() != c.want:
			t.Errorf("%T.Set(%q) then String() = %q, want %q", c.flag, c.in, c.flag.String(), c.want)
		}
	}
}
