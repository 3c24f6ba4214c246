package podstore

import (
	"testing"
)

// TestServiceAccountSurvivesReopen: the service account is part of the record
// on disk, so an agent restarted after the pod was enrolled hands the node
// proxy the same identity in its snapshot.
func TestServiceAccountSurvivesReopen(t *testing.T) {
	dir := t.TempDir()
	s, problems, err := Open(dir)
	if err != nil || len(problems) > 0 {
		t.Fatalf("open: %v %v", err, problems)
	}
	rec := Record{
		Key:            Key{Network: "k8s-pod-network", ContainerID: "c1", Ifname: "eth0"},
		Namespace:      "shop",
		Name:           "cart-0",
		UID:            "0f6c2a4e-uid",
		ServiceAccount: "cart",
		NetnsPath:      "/var/run/netns/cart-0",
	}
	if err := s.Put(rec); err != nil {
		t.Fatal(err)
	}
	again, problems, err := Open(dir)
	if err != nil || len(problems) > 0 {
		t.Fatalf("reopen: %v %v", err, problems)
	}
	got, ok := again.Get(rec.Key)
	if !ok {
		t.Fatal("record gone after reopen")
	}
	if got.ServiceAccount != "cart" {
		t.Fatalf("service account after reopen = %q, want %q", got.ServiceAccount, "cart")
	}
	read, err := Read(dir)
	if err != nil || len(read) != 1 || read[0].ServiceAccount != "cart" {
		t.Fatalf("Read = %+v, %v; want one record with service account cart", read, err)
	}
}
