package gateclient

import "strconv"

// The gate's messages (pkg/gate/gatepb/gate.proto) as far as the CNI plugin
// sends and reads them, with their field numbers. TestMessagesMatchGatepb
// checks every encoding against the generated code.

// Source says which entry point a request came through (gate.proto Source).
type Source int32

// SourceCNI is SOURCE_CNI.
const SourceCNI Source = 1

// Decision is what the agent did with a pod (gate.proto Decision).
type Decision int32

// The decisions.
const (
	DecisionUnspecified Decision = 0
	DecisionEnrolled    Decision = 1
	DecisionSkipped     Decision = 2
)

func (d Decision) String() string {
	return enumName(d, "DECISION_UNSPECIFIED", "DECISION_ENROLLED", "DECISION_SKIPPED")
}

// HealthStatus is grpc.health.v1's serving status.
type HealthStatus int32

// The serving statuses.
const (
	HealthUnknown        HealthStatus = 0
	HealthServing        HealthStatus = 1
	HealthNotServing     HealthStatus = 2
	HealthServiceUnknown HealthStatus = 3
)

func (s HealthStatus) String() string {
	return enumName(s, "UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")
}

// enumName is the proto name of v, given the names of the values from 0 up;
// a value without one is its number, as the generated code prints it.
func enumName[T ~int32](v T, names ...string) string {
	if v >= 0 && int(v) < len(names) {
		return names[v]
	}
	return strconv.FormatInt(int64(v), 10)
}

// PodIdentity is gate.proto PodIdentity without labels and annotations, which
// the CNI plugin never knows.
type PodIdentity struct {
	Namespace, Name, UID string
}

func (p PodIdentity) encode(e *encoder) {
	e.string(1, p.Namespace)
	e.string(2, p.Name)
	e.string(3, p.UID)
}

// Attachment is gate.proto Attachment.
type Attachment struct {
	ContainerID, Ifname, Network string
}

func (a Attachment) encode(e *encoder) {
	e.string(1, a.ContainerID)
	e.string(2, a.Ifname)
	e.string(3, a.Network)
}

func decodeAttachment(b []byte) (Attachment, error) {
	var a Attachment
	err := each(b, func(f field) error {
		var s *string
		switch f.num {
		case 1:
			s = &a.ContainerID
		case 2:
			s = &a.Ifname
		case 3:
			s = &a.Network
		default:
			return nil
		}
		if err := f.want(wireBytes); err != nil {
			return err
		}
		*s = string(f.bytes)
		return nil
	})
	return a, err
}

// Interface is gate.proto Interface.
type Interface struct {
	Name, MAC string
	Addresses []string
}

func (i Interface) encode(e *encoder) {
	e.string(1, i.Name)
	e.string(2, i.MAC)
	e.repeatedString(3, i.Addresses)
}

func encodeInterfaces(e *encoder, num int, ifs []Interface) {
	for _, i := range ifs {
		e.message(num, i.encode)
	}
}

// AddRequest is gate.proto AddRequest.
type AddRequest struct {
	Pod        PodIdentity
	Attachment Attachment
	NetnsPath  string
	Interfaces []Interface
	Source     Source
}

func (r *AddRequest) marshal() []byte {
	var e encoder
	e.message(1, r.Pod.encode)
	e.message(2, r.Attachment.encode)
	e.string(3, r.NetnsPath)
	encodeInterfaces(&e, 4, r.Interfaces)
	e.uint(5, uint64(r.Source))
	return e.b
}

// AddResponse is gate.proto AddResponse.
type AddResponse struct {
	Decision    Decision
	Reason      string
	NetnsCookie uint64
}

func (r *AddResponse) unmarshal(b []byte) error {
	return each(b, func(f field) error {
		switch f.num {
		case 1:
			if err := f.want(wireVarint); err != nil {
				return err
			}
			r.Decision = Decision(int32(f.v))
		case 2:
			if err := f.want(wireBytes); err != nil {
				return err
			}
			r.Reason = string(f.bytes)
		case 3:
			if err := f.want(wireVarint); err != nil {
				return err
			}
			r.NetnsCookie = f.v
		}
		return nil
	})
}

// DelRequest is gate.proto DelRequest; Pod is nil when the runtime did not
// say which pod.
type DelRequest struct {
	Pod        *PodIdentity
	Attachment Attachment
	NetnsPath  string
	Source     Source
}

func (r *DelRequest) marshal() []byte {
	var e encoder
	if r.Pod != nil {
		e.message(1, r.Pod.encode)
	}
	e.message(2, r.Attachment.encode)
	e.string(3, r.NetnsPath)
	e.uint(4, uint64(r.Source))
	return e.b
}

// DelResponse is gate.proto DelResponse.
type DelResponse struct {
	Released bool
}

func (r *DelResponse) unmarshal(b []byte) error {
	return each(b, func(f field) error {
		if f.num == 1 {
			if err := f.want(wireVarint); err != nil {
				return err
			}
			r.Released = f.v != 0
		}
		return nil
	})
}

// CheckRequest is gate.proto CheckRequest.
type CheckRequest struct {
	Pod        PodIdentity
	Attachment Attachment
	NetnsPath  string
	Interfaces []Interface
}

func (r *CheckRequest) marshal() []byte {
	var e encoder
	e.message(1, r.Pod.encode)
	e.message(2, r.Attachment.encode)
	e.string(3, r.NetnsPath)
	encodeInterfaces(&e, 4, r.Interfaces)
	return e.b
}

// GCRequest is gate.proto GCRequest.
type GCRequest struct {
	Network string
	Valid   []Attachment
}

func (r *GCRequest) marshal() []byte {
	var e encoder
	e.string(1, r.Network)
	for _, a := range r.Valid {
		e.message(2, a.encode)
	}
	return e.b
}

// GCResponse is gate.proto GCResponse.
type GCResponse struct {
	Released []Attachment
}

func (r *GCResponse) unmarshal(b []byte) error {
	return each(b, func(f field) error {
		if f.num != 1 {
			return nil
		}
		if err := f.want(wireBytes); err != nil {
			return err
		}
		a, err := decodeAttachment(f.bytes)
		if err != nil {
			return err
		}
		r.Released = append(r.Released, a)
		return nil
	})
}

// healthResponse reads grpc.health.v1 HealthCheckResponse.
func decodeHealth(b []byte) (HealthStatus, error) {
	var st HealthStatus
	err := each(b, func(f field) error {
		if f.num == 1 {
			if err := f.want(wireVarint); err != nil {
				return err
			}
			st = HealthStatus(int32(f.v))
		}
		return nil
	})
	return st, err
}
