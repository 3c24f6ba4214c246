package gaterpc

import (
	"context"

	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// ReleaseSandbox deletes every attachment gate holds for del's sandbox (container
// id) in del's network. Entry points whose teardown does not name interfaces
// (KNI detach, the hook's teardown) use it: the agent's records are the
// authority on which interfaces were enrolled. del's own attachment is used when
// the records cannot be listed. Failures are logged, never returned: a teardown
// must go on, and the agent's reconcile releases what is left once the
// namespace is gone.
func ReleaseSandbox(ctx context.Context, log *zap.Logger, g gatepb.GateServer, del *gatepb.DelRequest) {
	atts := []*gatepb.Attachment{del.GetAttachment()}
	if list, err := g.List(ctx, &gatepb.ListRequest{}); err != nil {
		log.Warn("listing the agent's enrollments failed; releasing the default interface only", zap.Error(err))
	} else {
		atts = atts[:0]
		for _, e := range list.GetEnrollments() {
			a := e.GetAttachment()
			if a.GetNetwork() == del.GetAttachment().GetNetwork() && a.GetContainerId() == del.GetAttachment().GetContainerId() {
				atts = append(atts, a)
			}
		}
	}
	for _, a := range atts {
		d := proto.Clone(del).(*gatepb.DelRequest)
		d.Attachment = a
		resp, err := g.Del(ctx, d)
		if err != nil {
			log.Warn("release from the mesh failed", zap.String("ifname", a.GetIfname()), zap.Error(err))
			continue
		}
		log.Info("released from the mesh", zap.String("ifname", a.GetIfname()), zap.Bool("held", resp.GetReleased()))
	}
}
