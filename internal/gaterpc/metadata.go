package gaterpc

import (
	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// LogFittedMetadata logs, in one line, what gate.FitPodMetadata changes in a
// runtime's labels and annotations; nothing when they fit.
func LogFittedMetadata(log *zap.Logger, labels, annotations map[string]string) {
	if _, notes := gate.FitPodMetadata(&gatepb.PodIdentity{Labels: labels, Annotations: annotations}); len(notes) > 0 {
		log.Warn("pod labels or annotations over the gate's bounds are not passed on as sent", zap.Strings("changed", notes))
	}
}
