package idempotency

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyv1"
)

// fake is an in-process coordinator whose answers the test scripts: for the client's own
// decisions (retries, error decoding, bounds) that the real one cannot be made to show at will.
type fake struct {
	pb.UnimplementedIdempotencyServiceServer
	mu        sync.Mutex
	tryStarts []*pb.TryStartRequest
	deadlines []time.Duration
	marks     int
	calls     int
	// failures are answered, in order, before the success.
	failures []error
}

func (f *fake) next(ctx context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if d, ok := ctx.Deadline(); ok {
		f.deadlines = append(f.deadlines, time.Until(d))
	}
	if len(f.failures) == 0 {
		return nil
	}
	err := f.failures[0]
	if err == errFakeForever {
		return status.Error(codes.Unavailable, "down")
	}
	f.failures = f.failures[1:]
	return err
}

var errFakeForever = errors.New("unavailable forever")

func (f *fake) TryStart(ctx context.Context, r *pb.TryStartRequest) (*pb.TryStartResponse, error) {
	f.mu.Lock()
	f.tryStarts = append(f.tryStarts, r)
	f.mu.Unlock()
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	return &pb.TryStartResponse{Outcome: &pb.TryStartResponse_Started{Started: &pb.ClaimStarted{
		LeaseToken: 7, Attempt: 1, LeaseExpiresAt: timestamppb.New(time.Now().Add(30 * time.Second)),
	}}}, nil
}

func (f *fake) MarkProcessed(ctx context.Context, r *pb.MarkProcessedRequest) (*pb.MarkProcessedResponse, error) {
	f.mu.Lock()
	f.marks++
	f.mu.Unlock()
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	answer := &pb.MarkProcessedResponse{}
	for _, id := range r.GetEventIds() {
		answer.Results = append(answer.Results, &pb.ProcessedEvent{EventId: id})
	}
	return answer, nil
}

func (f *fake) Lookup(ctx context.Context, r *pb.LookupRequest) (*pb.LookupResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	return &pb.LookupResponse{State: &pb.LookupResponse_Absent{Absent: &pb.KeyAbsent{}}}, nil
}

func (f *fake) Release(ctx context.Context, r *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	return &pb.ReleaseResponse{}, nil
}

func (f *fake) callCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// startFake serves f and answers a client of it (quick retries unless opts say otherwise).
func startFake(t *testing.T, f *fake, opts ...Option) *Client {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	pb.RegisterIdempotencyServiceServer(server, f)
	go func() { _ = server.Serve(l) }()
	t.Cleanup(server.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	quick := RetryPolicy{InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Multiplier: 2, Budget: 5 * time.Second}
	c, err := NewFromConn(conn, append([]Option{WithRetryPolicy(quick)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// rich is a status as the coordinator makes them: an ErrorInfo reason, maybe a RetryInfo and a
// BadRequest.
func rich(code codes.Code, reason string, retry time.Duration, fields ...string) error {
	st, err := status.New(code, "scripted "+reason).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain})
	if err != nil {
		panic(err)
	}
	if retry > 0 {
		if st, err = st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retry)}); err != nil {
			panic(err)
		}
	}
	if len(fields) > 0 {
		bad := &errdetails.BadRequest{}
		for _, f := range fields {
			bad.FieldViolations = append(bad.FieldViolations, &errdetails.BadRequest_FieldViolation{Field: f, Description: "bad " + f})
		}
		if st, err = st.WithDetails(bad); err != nil {
			panic(err)
		}
	}
	return st.Err()
}
