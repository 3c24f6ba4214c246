package agent

import (
	"context"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// CNIConfigInstaller installs the chain entry and keeps it in place until ctx
// ends, reporting every change of its state.
type CNIConfigInstaller func(ctx context.Context, report func(CNIStatus)) error

// CNIStatus is the chain entry's state as the installer reports it.
type CNIStatus struct {
	InPlace bool
	Reason  string
	Mode    string
	Primary string
	File    string
	// Network is the chain's CNI network name.
	Network string
	Repairs uint64
	// Dirs says where the plugin and the entry go, and why there.
	Dirs string
}

// setCNIStatus records the installer's latest report.
func (s *Service) setCNIStatus(st CNIStatus) {
	prev := s.cni.Swap(&st)
	if prev != nil && st.Repairs > prev.Repairs {
		s.metrics.chainRepaired(st.Repairs - prev.Repairs)
	}
}

// Status implements gatepb.GateServer.
func (s *Service) Status(context.Context, *gatepb.StatusRequest) (*gatepb.StatusResponse, error) {
	ready, _ := s.readiness.Ready()
	resp := &gatepb.StatusResponse{Ready: ready, Datapath: s.datapathName, Enrolled: int32(len(s.enrolled())), CniConfig: &gatepb.CNIConfig{}}
	for _, c := range s.readiness.Conditions() {
		resp.Conditions = append(resp.Conditions, &gatepb.Condition{Name: c.Name, Ok: c.OK, Reason: c.Reason})
	}
	if st := s.cni.Load(); st != nil {
		resp.CniConfig = &gatepb.CNIConfig{Managed: true, InPlace: st.InPlace, Mode: st.Mode, PrimaryFile: st.Primary,
			File: st.File, Repairs: st.Repairs, Reason: st.Reason, Dirs: st.Dirs}
	}
	return resp, nil
}
